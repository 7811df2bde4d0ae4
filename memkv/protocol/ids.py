"""The one rule for session ids, checked once, where a session is created.

Ids travel in URL paths, file names of manifests and logs, so they are a
conservative ASCII subset: no path separators, no ``.``/``..``, no spaces or
control characters. An id accepted here is accepted everywhere after.
"""

from __future__ import annotations

import re

from memkv.errors import InvalidInputError

__all__ = [
    "MAX_SESSION_ID_LEN",
    "NAMESPACE_PATTERN",
    "NAME_PATTERN",
    "PARTITION_SEPARATOR",
    "PUBLISHER_SEPARATOR",
    "SESSION_ID_PATTERN",
    "TENANT_SEPARATOR",
    "check_name",
    "check_session_id",
    "hashed_session_id",
    "is_session_id",
    "check_stored_session_id",
    "partition_of",
    "public_namespace_of",
    "publisher_namespace",
    "scoped_session_id",
    "unscoped_session_id",
]

MAX_SESSION_ID_LEN = 256
#: Starts with a letter or digit, then letters, digits and ``._:@-``.
SESSION_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,255}$"
_SESSION_ID = re.compile(SESSION_ID_PATTERN)
#: Tenants and namespaces: a letter or digit, then letters, digits and ``._-``
#: (no ``/``: a tenant scopes session ids as ``<tenant>/<session id>``).
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
_NAME = re.compile(NAME_PATTERN)
#: Separates a tenant from its session ids in the router's table; in neither alphabet.
TENANT_SEPARATOR = "/"
#: Separates a public namespace from the tenant that published into it; not in the
#: names' alphabet either, so no tenant can name another publisher's namespace.
PUBLISHER_SEPARATOR = "@"
#: Starts a partition of the caller's own namespace: ``#<partition>`` names
#: ``<tenant>#<partition>``, whose blocks are hashed apart from the tenant's other
#: ones (an engine shared by tenants keeps each one's KV in its own: vLLM's
#: ``cache_salt``). Not in the names' alphabet: nobody names another's partition.
PARTITION_SEPARATOR = "#"
_PARTITION = r"#[A-Za-z0-9_-]{1,64}"
#: A namespace a request may name: a tenant's or public namespace, or ``#<partition>``
#: of the caller's own.
NAMESPACE_PATTERN = rf"^([A-Za-z0-9][A-Za-z0-9._-]{{0,63}}|{_PARTITION})$"
_PARTITION_ONLY = re.compile(rf"^{_PARTITION}$")


def partition_of(namespace: str | None) -> str | None:
    """The partition a requested namespace names (``#p``: ``p``), else None."""
    if namespace is None or not namespace.startswith(PARTITION_SEPARATOR):
        return None
    if not _PARTITION_ONLY.match(namespace):
        raise InvalidInputError(
            f"a partition is '#' and 1..64 of A-Z a-z 0-9 _ -, got {namespace!r}")
    return namespace[1:]


def publisher_namespace(public: str, tenant: str) -> str:
    """The namespace ``tenant``'s blocks in public namespace ``public`` are hashed under.

    Every publisher of a public namespace has its own: two publishers' KV for
    the same tokens are two blocks, and neither can replace the other's
    (a reader chooses whose it trusts). Identical bytes are kept once per
    publisher: the price of never taking one publisher's word for another's.
    """
    return f"{check_name(public, 'namespace')}{PUBLISHER_SEPARATOR}{check_name(tenant, 'tenant')}"


def public_namespace_of(namespace: str) -> str:
    """The public namespace a publisher's namespace belongs to (a plain one: itself)."""
    return namespace.partition(PUBLISHER_SEPARATOR)[0]


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


def is_session_id(value: str) -> bool:
    """Whether ``value`` is a valid session id as it is."""
    return _SESSION_ID.fullmatch(value) is not None


def hashed_session_id(value: str) -> str:
    """A session id named by ``value``, any string (a conversation id an SDK made, a
    cache key): the same string always names the same session."""
    import hashlib

    return "h-" + hashlib.blake2b(value.encode(), digest_size=16).hexdigest()


def check_name(name: object, what: str = "name") -> str:
    """Return a tenant or namespace name if it follows :data:`NAME_PATTERN`.

    Raises:
        InvalidInputError: otherwise.
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidInputError(
            f"{what} must be 1..64 characters of A-Z a-z 0-9 . _ - starting with a letter or "
            f"digit, got {name!r:.80}"
        )
    return name


def scoped_session_id(tenant: str | None, session_id: str) -> str:
    """The router's id of a tenant's session: ``<tenant>/<session id>`` (None: unscoped).

    Tenants never share session ids: another tenant's session is just another
    key, so it answers exactly as a missing one does.
    """
    check_session_id(session_id)
    return session_id if tenant is None else f"{check_name(tenant, 'tenant')}/{session_id}"


def unscoped_session_id(stored: str) -> str:
    """The session id a tenant sees for the router's id ``stored``."""
    return stored.rpartition(TENANT_SEPARATOR)[2]


def check_stored_session_id(stored: object) -> str:
    """Return a router id (``session id`` or ``tenant/session id``) if both parts follow the rules.

    Raises:
        InvalidInputError: otherwise.
    """
    if not isinstance(stored, str):
        check_session_id(stored)  # raises with the usual message
    tenant, sep, session_id = str(stored).partition(TENANT_SEPARATOR)
    if not sep:
        return check_session_id(stored)
    check_name(tenant, "tenant")
    check_session_id(session_id)
    return str(stored)
