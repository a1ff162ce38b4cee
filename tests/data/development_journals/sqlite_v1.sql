-- A SQLite journal at development schema version 1, as idempotently's builds made it
-- (the DDL of the build at git tag v0.1.0.dev-journal5): the refusal tests' input.
CREATE TABLE operations (
    operation_id     TEXT PRIMARY KEY,
    key              TEXT NOT NULL UNIQUE,
    status           TEXT NOT NULL CHECK (status = 'pending' OR status = 'succeeded' OR status = 'failed' OR status = 'needs_reconcile' OR status = 'abandoned'),
    delivery         TEXT NOT NULL CHECK (delivery IN ('exactly_once', 'at_most_once')),
    method           TEXT NOT NULL,
    url              TEXT NOT NULL,
    request_headers  TEXT NOT NULL,
    request_body     BLOB NOT NULL,
    fingerprint      TEXT NOT NULL,
    profile          TEXT NOT NULL,
    key_header       TEXT NOT NULL,
    created_at       REAL NOT NULL,
    updated_at       REAL NOT NULL,
    key_expires_at   REAL NOT NULL,
    deadline_at      REAL,
    not_before       REAL,
    lease_owner      TEXT,
    lease_until      REAL NOT NULL DEFAULT 0,
    attempt_count    INTEGER NOT NULL DEFAULT 0,
    last_status_code INTEGER,
    response_status  INTEGER,
    response_headers TEXT,
    response_body    BLOB,
    reason           TEXT
);
CREATE INDEX operations_by_status ON operations (status);
CREATE TABLE attempts (
    operation_id TEXT NOT NULL,
    number      INTEGER NOT NULL,
    started_at  REAL NOT NULL,
    elapsed     REAL NOT NULL,
    outcome     TEXT NOT NULL CHECK (outcome = 'not_sent' OR outcome = 'maybe_delivered' OR outcome = 'answered'),
    status_code INTEGER,
    replayed    INTEGER NOT NULL DEFAULT 0,
    error       TEXT,
    wait        REAL,
    PRIMARY KEY (operation_id, number)
) WITHOUT ROWID;
PRAGMA application_id = 1229213008;
PRAGMA user_version = 1;
