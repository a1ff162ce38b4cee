-- A PostgreSQL journal at development schema version 3, as idempotently's builds made it
-- (the DDL of the build at git tag v0.1.0.dev-journal5): the refusal tests' input.
CREATE SCHEMA IF NOT EXISTS idempotently;
CREATE TABLE idempotently.journal_meta (
    name  text PRIMARY KEY,
    value text NOT NULL
);
CREATE TABLE idempotently.operations (
    seq              bigint GENERATED ALWAYS AS IDENTITY,
    operation_id     text PRIMARY KEY,
    key              text NOT NULL UNIQUE,
    status           text NOT NULL CHECK (status IN ('pending', 'succeeded', 'failed', 'needs_reconcile', 'abandoned')),
    delivery         text NOT NULL CHECK (delivery IN ('exactly_once', 'at_most_once')),
    method           text NOT NULL,
    url              text NOT NULL,
    request_headers  text NOT NULL,
    request_body     bytea NOT NULL,
    fingerprint      text NOT NULL,
    profile          text NOT NULL,
    key_header       text NOT NULL,
    created_at       double precision NOT NULL,
    updated_at       double precision NOT NULL,
    key_expires_at   double precision NOT NULL,
    deadline_at      double precision,
    not_before       double precision,
    lease_owner      text,
    lease_until      double precision NOT NULL DEFAULT 0,
    attempt_count    integer NOT NULL DEFAULT 0,
    last_status_code integer,
    response_status  integer,
    response_headers text,
    response_body    bytea,
    reason           text
);
CREATE INDEX operations_by_seq ON idempotently.operations (seq);
CREATE INDEX operations_by_status ON idempotently.operations (status, seq);
CREATE INDEX operations_pending ON idempotently.operations (created_at)
    INCLUDE (lease_until, updated_at, not_before) WHERE status = 'pending';
CREATE INDEX operations_finished ON idempotently.operations (updated_at)
    WHERE status IN ('succeeded', 'failed', 'abandoned');
CREATE TABLE idempotently.attempts (
    operation_id text NOT NULL,
    number       integer NOT NULL,
    started_at   double precision NOT NULL,
    elapsed      double precision NOT NULL,
    outcome      text NOT NULL CHECK (outcome IN ('not_sent', 'maybe_delivered', 'answered')),
    status_code  integer,
    replayed     integer NOT NULL DEFAULT 0,
    error        text,
    wait         double precision,
    PRIMARY KEY (operation_id, number)
);
ALTER TABLE idempotently.operations
    -- Data at rest.
    ADD COLUMN codec text,
    ADD COLUMN secret_params text,
    ADD COLUMN credentials_digest text,
    -- Retry control.
    ADD COLUMN overrides text,
    -- The operator's journal.
    ADD COLUMN forked_from text,
    ADD COLUMN lookup_after double precision,
    -- The outbox.
    ADD COLUMN enqueued_at double precision,
    ADD COLUMN first_send_at double precision;
CREATE TABLE idempotently.origin_pauses (
    origin      text NOT NULL,
    credentials text NOT NULL DEFAULT '',
    until       double precision NOT NULL,
    reason      text,
    set_at      double precision NOT NULL,
    PRIMARY KEY (origin, credentials)
);
CREATE INDEX operations_forks ON idempotently.operations (forked_from)
    WHERE forked_from IS NOT NULL;
CREATE TABLE idempotently.operation_audit (
    seq          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    operation_id text NOT NULL,
    at           double precision NOT NULL,
    actor        text NOT NULL,
    action       text NOT NULL,
    note         text,
    detail       text
);
CREATE INDEX operation_audit_by_operation ON idempotently.operation_audit (operation_id, seq);
ALTER TABLE idempotently.operations ADD COLUMN body_digest bytea;
INSERT INTO idempotently.journal_meta (name, value) VALUES ('namespace', '6ba7b810-9dad-11d1-80b4-00c04fd430c8');
INSERT INTO idempotently.journal_meta (name, value) VALUES ('schema_version', '3');
