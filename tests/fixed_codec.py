"""A codec with a fixed key, for tests that pass it between processes (``--codec``).

Test data only: a real key comes from a secret manager, never from source code.
"""

from __future__ import annotations

import idempotently

CODEC = idempotently.FernetCodec(b"RrU72ISKJW8uHtOtsPdtiqRYYFknZhFedB13RpZRLEM=")
