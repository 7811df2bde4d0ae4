"""The one rule for session ids, checked once, where a session is created.

Ids travel in URL paths, file names of manifests and logs, so they are a
conservative ASCII subset: no path separators, no ``.``/``..``, no spaces or
control characters. An id accepted here is accepted everywhere after.
"""

from __future__ import annotations

import re

from memkv.errors import InvalidInputError

__all__ = ["MAX_SESSION_ID_LEN", "SESSION_ID_PATTERN", "check_session_id"]

MAX_SESSION_ID_LEN = 256
#: Starts with a letter or digit, then letters, digits and ``._:@-``.
SESSION_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,255}$"
_SESSION_ID = re.compile(SESSION_ID_PATTERN)


def check_session_id(session_id: object) -> str:
    """Return ``session_id`` if it follows the rule.

    Raises:
        InvalidInputError: not a str, empty, longer than 256 characters, or with
            a character outside ``A-Z a-z 0-9 . _ : @ -`` (or not starting with a
            letter or digit).
    """
    if not isinstance(session_id, str) or not _SESSION_ID.fullmatch(session_id):
        raise InvalidInputError(
            f"session id must be 1..{MAX_SESSION_ID_LEN} characters of A-Z a-z 0-9 . _ : @ - "
            f"starting with a letter or digit, got {session_id!r:.80}"
        )
    return session_id
