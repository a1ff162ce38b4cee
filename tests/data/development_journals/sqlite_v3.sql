-- A SQLite journal at development schema version 3, as idempotently's builds made it
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
CREATE TABLE journal_meta (
    name  TEXT PRIMARY KEY,
    value TEXT NOT NULL
) WITHOUT ROWID;
CREATE TABLE journal_counts (
    id                   INTEGER PRIMARY KEY CHECK (id = 1),
    pending              INTEGER NOT NULL,
    succeeded            INTEGER NOT NULL,
    failed               INTEGER NOT NULL,
    needs_reconcile      INTEGER NOT NULL,
    abandoned            INTEGER NOT NULL,
    unknown_status       INTEGER NOT NULL,
    attempts             INTEGER NOT NULL,
    answered_attempts    INTEGER NOT NULL,
    replayed_attempts    INTEGER NOT NULL,
    in_progress_attempts INTEGER NOT NULL
);
CREATE INDEX operations_pending
    ON operations (created_at, lease_until, updated_at, not_before, status)
    WHERE status = 'pending';
CREATE INDEX operations_finished
    ON operations (updated_at, status)
    WHERE (status = 'succeeded' OR status = 'failed' OR status = 'abandoned');
CREATE TRIGGER count_new_operation AFTER INSERT ON operations BEGIN
    UPDATE journal_counts SET
        pending = pending + (NEW.status = 'pending'),
        succeeded = succeeded + (NEW.status = 'succeeded'),
        failed = failed + (NEW.status = 'failed'),
        needs_reconcile = needs_reconcile + (NEW.status = 'needs_reconcile'),
        abandoned = abandoned + (NEW.status = 'abandoned'),
        unknown_status = unknown_status + (NOT (NEW.status = 'pending' OR NEW.status = 'succeeded' OR NEW.status = 'failed' OR NEW.status = 'needs_reconcile' OR NEW.status = 'abandoned'));
END;
CREATE TRIGGER count_deleted_operation AFTER DELETE ON operations BEGIN
    UPDATE journal_counts SET
        pending = pending - (OLD.status = 'pending'),
        succeeded = succeeded - (OLD.status = 'succeeded'),
        failed = failed - (OLD.status = 'failed'),
        needs_reconcile = needs_reconcile - (OLD.status = 'needs_reconcile'),
        abandoned = abandoned - (OLD.status = 'abandoned'),
        unknown_status = unknown_status - (NOT (OLD.status = 'pending' OR OLD.status = 'succeeded' OR OLD.status = 'failed' OR OLD.status = 'needs_reconcile' OR OLD.status = 'abandoned'));
END;
CREATE TRIGGER count_status_change AFTER UPDATE OF status ON operations
WHEN OLD.status IS NOT NEW.status BEGIN
    UPDATE journal_counts SET
        pending = pending - (OLD.status = 'pending') + (NEW.status = 'pending'),
        succeeded = succeeded - (OLD.status = 'succeeded') + (NEW.status = 'succeeded'),
        failed = failed - (OLD.status = 'failed') + (NEW.status = 'failed'),
        needs_reconcile = needs_reconcile - (OLD.status = 'needs_reconcile') + (NEW.status = 'needs_reconcile'),
        abandoned = abandoned - (OLD.status = 'abandoned') + (NEW.status = 'abandoned'),
        unknown_status = unknown_status - (NOT (OLD.status = 'pending' OR OLD.status = 'succeeded' OR OLD.status = 'failed' OR OLD.status = 'needs_reconcile' OR OLD.status = 'abandoned')) + (NOT (NEW.status = 'pending' OR NEW.status = 'succeeded' OR NEW.status = 'failed' OR NEW.status = 'needs_reconcile' OR NEW.status = 'abandoned'));
END;
CREATE TRIGGER count_new_attempt AFTER INSERT ON attempts BEGIN
    UPDATE journal_counts SET
        attempts = attempts + 1,
        answered_attempts = answered_attempts + (NEW.status_code IS NOT NULL),
        replayed_attempts = replayed_attempts + NEW.replayed,
        in_progress_attempts = in_progress_attempts + coalesce(NEW.status_code IN (409, 423), 0);
END;
CREATE TRIGGER count_deleted_attempt AFTER DELETE ON attempts BEGIN
    UPDATE journal_counts SET
        attempts = attempts - 1,
        answered_attempts = answered_attempts - (OLD.status_code IS NOT NULL),
        replayed_attempts = replayed_attempts - OLD.replayed,
        in_progress_attempts = in_progress_attempts - coalesce(OLD.status_code IN (409, 423), 0);
END;
CREATE TRIGGER count_changed_attempt AFTER UPDATE OF status_code, replayed ON attempts BEGIN
    UPDATE journal_counts SET
        attempts = attempts - 1 + 1,
        answered_attempts = answered_attempts - (OLD.status_code IS NOT NULL) + (NEW.status_code IS NOT NULL),
        replayed_attempts = replayed_attempts - OLD.replayed + NEW.replayed,
        in_progress_attempts = in_progress_attempts - coalesce(OLD.status_code IN (409, 423), 0) + coalesce(NEW.status_code IN (409, 423), 0);
END;
INSERT OR REPLACE INTO journal_counts SELECT 1,
    (SELECT count(*) FROM operations WHERE status = 'pending'), (SELECT count(*) FROM operations WHERE status = 'succeeded'), (SELECT count(*) FROM operations WHERE status = 'failed'), (SELECT count(*) FROM operations WHERE status = 'needs_reconcile'), (SELECT count(*) FROM operations WHERE status = 'abandoned'),
    (SELECT count(*) FROM operations WHERE status NOT IN ('pending', 'succeeded', 'failed', 'needs_reconcile', 'abandoned')),
    count(*),
    count(status_code),
    coalesce(sum(replayed), 0),
    coalesce(sum(status_code IN (409, 423)), 0)
FROM attempts;
INSERT INTO journal_meta (name, value) VALUES ('namespace', '6ba7b810-9dad-11d1-80b4-00c04fd430c8');
DROP INDEX operations_by_status;
DROP INDEX operations_finished;
CREATE INDEX operations_settled ON operations (status, updated_at) WHERE (status = 'succeeded' OR status = 'failed' OR status = 'needs_reconcile' OR status = 'abandoned');
DROP TRIGGER count_new_operation;
CREATE TRIGGER count_new_operation AFTER INSERT ON operations
WHEN NEW.status IS NOT 'pending' BEGIN
    UPDATE journal_counts SET
        succeeded = succeeded + (NEW.status = 'succeeded'),
        failed = failed + (NEW.status = 'failed'),
        needs_reconcile = needs_reconcile + (NEW.status = 'needs_reconcile'),
        abandoned = abandoned + (NEW.status = 'abandoned'),
        unknown_status = unknown_status + (NOT (NEW.status = 'pending' OR NEW.status = 'succeeded' OR NEW.status = 'failed' OR NEW.status = 'needs_reconcile' OR NEW.status = 'abandoned'));
END;
DROP TRIGGER count_deleted_operation;
CREATE TRIGGER count_deleted_operation AFTER DELETE ON operations
WHEN OLD.status IS NOT 'pending' BEGIN
    UPDATE journal_counts SET
        succeeded = succeeded - (OLD.status = 'succeeded'),
        failed = failed - (OLD.status = 'failed'),
        needs_reconcile = needs_reconcile - (OLD.status = 'needs_reconcile'),
        abandoned = abandoned - (OLD.status = 'abandoned'),
        unknown_status = unknown_status - (NOT (OLD.status = 'pending' OR OLD.status = 'succeeded' OR OLD.status = 'failed' OR OLD.status = 'needs_reconcile' OR OLD.status = 'abandoned'));
END;
DROP TRIGGER count_status_change;
CREATE TRIGGER count_status_change AFTER UPDATE OF status ON operations
WHEN OLD.status IS NOT NEW.status BEGIN
    UPDATE journal_counts SET
        succeeded = succeeded - (OLD.status = 'succeeded') + (NEW.status = 'succeeded'),
        failed = failed - (OLD.status = 'failed') + (NEW.status = 'failed'),
        needs_reconcile = needs_reconcile - (OLD.status = 'needs_reconcile') + (NEW.status = 'needs_reconcile'),
        abandoned = abandoned - (OLD.status = 'abandoned') + (NEW.status = 'abandoned'),
        unknown_status = unknown_status - (NOT (OLD.status = 'pending' OR OLD.status = 'succeeded' OR OLD.status = 'failed' OR OLD.status = 'needs_reconcile' OR OLD.status = 'abandoned')) + (NOT (NEW.status = 'pending' OR NEW.status = 'succeeded' OR NEW.status = 'failed' OR NEW.status = 'needs_reconcile' OR NEW.status = 'abandoned'));
END;
UPDATE journal_counts SET pending = 0;
PRAGMA user_version = 3;
