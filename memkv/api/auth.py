"""Who is calling: bearer tokens mapped to a tenant, roles and namespaces.

The gateway authenticates every request but its health probes (and, where the
deployment says so, ``/metrics`` and the API docs). A token maps to a
:class:`Principal`: its **tenant** (which scopes session ids: another tenant's
session answers 404 like a missing one, and is the default namespace its block
hashes are salted with), its **roles** and the **public namespaces** it may read
or publish into. The tenant always comes from the token, never from the request.

Roles:
    ``read``  — read its tenant's sessions and blocks, match prefixes.
    ``write`` — also create, append, suspend, resume and delete sessions.
    ``admin`` — cluster-wide statistics and operations (any tenant's figures).
    ``metrics`` — only ``/metrics`` with its per-tenant series (a Prometheus scraper's
    token); the open ``/metrics`` carries nothing tenant-specific.

Public namespaces (shared system prompts, tool schemas) are the only way
tenants share blocks. Only tokens that may **publish** into one write blocks
there, so nobody can plant garbage under a prompt another tenant will look up
(prefix poisoning); a token reads one only where it may **read** it.

Tokens are kept only as SHA-256 digests: a token file (or the Kubernetes Secret
mounted as one, or the ``MEMKV_TOKENS`` variable holding the same document)
lists::

    tokens:
      - sha256: 5e884898da28047151d0e56f8dc62927...   # sha256 hex of the token
        tenant: acme
        roles: [write]
        publish: [shared-prompts]   # public namespaces it writes (and reads)
        read: [docs-corpus]         # public namespaces it reads
    tenants:                        # quotas (507 when exceeded); default: config
      acme: {max_sessions: 1000, max_bytes: 68719476736}

``memkv token new --tenant acme --role write`` prints a fresh token and its
entry. A presented token is hashed, looked up by digest, and the digests
compared with :func:`hmac.compare_digest`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict, Unpack

import yaml

from memkv.errors import ConfigError, ForbiddenError, UnauthorizedError
from memkv.protocol.ids import (
    PARTITION_SEPARATOR,
    check_name,
    partition_of,
    publisher_namespace,
)

__all__ = [
    "ROLES",
    "TOKENS_ENV",
    "Authenticator",
    "Principal",
    "Quota",
    "TokenEntry",
    "hash_token",
    "new_token",
]

ROLES = ("read", "write", "admin", "metrics")
#: A token document (YAML or JSON) in the environment, e.g. from a Secret.
TOKENS_ENV = "MEMKV_TOKENS"
_BEARER = "bearer "
# Tokens longer than this are refused before hashing (a header is not a body).
_MAX_TOKEN_CHARS = 512


def hash_token(token: str) -> str:
    """The SHA-256 hex digest a token is stored as."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def new_token() -> str:
    """A fresh random token (256 bits, URL-safe)."""
    return "mkv_" + secrets.token_urlsafe(32)


@dataclass(frozen=True, slots=True)
class Principal:
    """The caller a request acts for.

    Attributes:
        tenant: scopes session ids and is the default namespace; None for an
            unauthenticated gateway (one trusted user: ids are not scoped).
        roles: of :data:`ROLES`.
        publish: public namespaces it may write blocks into (and read).
        read: public namespaces it may read.
        trust: per public namespace it may read, the publishers (tenants) whose
            blocks it gets, in order of preference; a namespace missing here
            gives nothing.
        any_namespace: an unauthenticated gateway's caller names any namespace.
    """

    tenant: str | None
    roles: frozenset[str]
    publish: frozenset[str] = frozenset()
    read: frozenset[str] = frozenset()
    trust: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    any_namespace: bool = False
    max_sessions: int | None = None  # the tenant's quota (None: no limit)
    max_bytes: int | None = None  # of KV over all its sessions, in the model dtype

    @property
    def quota(self) -> tuple[int | None, int | None] | None:
        """``(max sessions, max bytes)`` for the router, or None when unlimited."""
        if self.max_sessions is None and self.max_bytes is None:
            return None
        return self.max_sessions, self.max_bytes

    @classmethod
    def trusted(cls) -> Principal:
        """The caller of a gateway without authentication: everything is allowed."""
        return cls(None, frozenset(ROLES), any_namespace=True)

    @property
    def default_namespace(self) -> str:
        return self.tenant if self.tenant is not None else "default"

    def require(self, role: str) -> None:
        """Raise ForbiddenError unless the principal has ``role`` (``write`` implies ``read``)."""
        held = self.roles | ({"read"} if "write" in self.roles else set())
        if role not in held:
            raise ForbiddenError(f"this token may not {_VERBS[role]} (it needs the {role!r} role)")

    @property
    def sees_tenants(self) -> bool:
        """Whether ``/metrics`` shows it per-tenant series (``metrics`` or ``admin`` role)."""
        return bool(self.roles & {"metrics", "admin"})

    def readable(self) -> frozenset[str] | None:
        """Namespaces whose blocks it may read (None: any)."""
        if self.any_namespace:
            return None
        return frozenset({self.default_namespace}) | self.publish | self.read

    def write_namespace(self, namespace: str | None) -> str:
        """The namespace a new session of this caller stores its blocks under.

        Raises:
            ForbiddenError: a namespace it may not publish into.
        """
        partition = partition_of(namespace)
        if partition is not None:  # a partition of its own namespace
            return f"{self.default_namespace}{PARTITION_SEPARATOR}{partition}"
        if namespace is None or namespace == self.default_namespace or self.any_namespace:
            return namespace if namespace is not None else self.default_namespace
        if namespace not in self.publish:
            raise ForbiddenError(
                f"this token may not write into namespace {namespace!r}: only its tenant's own "
                f"({self.default_namespace!r}) and the public namespaces it may publish into"
            )
        # Its own corner of the public namespace: no other publisher's blocks
        # can stand in for the ones it writes (docs/security.md).
        assert self.tenant is not None
        return publisher_namespace(namespace, self.tenant)

    def read_namespaces(self, namespace: str | None) -> list[str]:
        """The namespaces a lookup (match, blocks by key) reads, in order of preference.

        The tenant's own, or for a public namespace one per publisher the token
        trusts there (a publisher's blocks are hashed under its own).

        Raises:
            ForbiddenError: a namespace it may not read.
        """
        partition = partition_of(namespace)
        if partition is not None:  # a partition of its own namespace
            return [f"{self.default_namespace}{PARTITION_SEPARATOR}{partition}"]
        if namespace is None or self.any_namespace:
            return [namespace if namespace is not None else self.default_namespace]
        if namespace == self.default_namespace:
            return [namespace]
        allowed = self.readable()
        if allowed is not None and namespace not in allowed:
            raise ForbiddenError(f"this token may not read namespace {namespace!r}")
        return [publisher_namespace(namespace, t) for t in self.trust.get(namespace, ())]


_VERBS = {
    "read": "read sessions",
    "write": "change sessions",
    "admin": "see the whole cluster",
    "metrics": "see per-tenant metrics",
}


@dataclass(frozen=True, slots=True)
class TokenEntry:
    """One token as stored: its digest and what it may do."""

    sha256: str
    tenant: str
    roles: frozenset[str]
    publish: frozenset[str] = frozenset()
    read: frozenset[str] = frozenset()
    # Per public namespace, the publishers it trusts (absent: the namespace's declared
    # owners, and its own tenant where it publishes; never every publisher).
    trust: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    @classmethod
    def parse(cls, raw: Mapping[str, Any], where: str) -> TokenEntry:
        """Validate one entry of a token document.

        Raises:
            ConfigError: naming ``where`` and what is wrong.
        """
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__}")
        unknown = set(raw) - {"sha256", "tenant", "roles", "publish", "read", "trust"}
        if unknown:
            raise ConfigError(f"{where}: unknown keys {sorted(unknown)}")
        digest = raw.get("sha256")
        if not isinstance(digest, str) or len(digest) != 64:
            raise ConfigError(f"{where}: 'sha256' must be the 64-hex-digit SHA-256 of the token")
        try:
            bytes.fromhex(digest)
        except ValueError:
            raise ConfigError(f"{where}: 'sha256' is not hex") from None
        try:
            tenant = check_name(raw.get("tenant"), "tenant")
            roles = _names(raw.get("roles", ["read"]), "roles")
            publish = _names(raw.get("publish", []), "publish")
            read = _names(raw.get("read", []), "read")
            trust = _trust(raw.get("trust", {}))
        except Exception as e:
            raise ConfigError(f"{where}: {e}") from None
        bad = roles - set(ROLES)
        if bad or not roles:
            raise ConfigError(f"{where}: roles must be some of {list(ROLES)}, got {sorted(roles)}")
        if tenant in publish | read:
            raise ConfigError(f"{where}: a tenant's own namespace is not a public one")
        if set(trust) - (publish | read):
            raise ConfigError(
                f"{where}: 'trust' names namespaces it may not read: "
                f"{sorted(set(trust) - (publish | read))}"
            )
        return cls(digest.lower(), tenant, roles, publish, read, trust)

    def principal(
        self,
        quota: Quota | None = None,
        owners: Mapping[str, tuple[str, ...]] | None = None,
    ) -> Principal:
        """What this token may do.

        Args:
            owners: each public namespace's declared owners (the token document's
                ``namespaces``): the trust of a namespace its ``trust`` does not
                name, after its own tenant where it publishes there. A publisher
                nobody declared is believed by no reader that did not name it.
        """
        limits = quota if quota is not None else Quota()
        declared = owners or {}
        trust: dict[str, tuple[str, ...]] = {}
        for namespace in self.publish | self.read:
            chosen = self.trust.get(namespace)
            if chosen is None:
                chosen = tuple(declared.get(namespace, ()))
                if namespace in self.publish:
                    chosen = (self.tenant, *(t for t in chosen if t != self.tenant))
            trust[namespace] = chosen
        return Principal(
            self.tenant,
            self.roles,
            self.publish,
            self.read,
            trust,
            max_sessions=limits.max_sessions,
            max_bytes=limits.max_bytes,
        )


@dataclass(frozen=True, slots=True)
class Quota:
    """What one tenant may hold (None: no limit)."""

    max_sessions: int | None = None
    max_bytes: int | None = None

    @classmethod
    def parse(cls, raw: Any, where: str) -> Quota:
        if not isinstance(raw, Mapping) or set(raw) - {"max_sessions", "max_bytes"}:
            raise ConfigError(f"{where}: expected a mapping of max_sessions and max_bytes")
        values = {}
        for name in ("max_sessions", "max_bytes"):
            value = raw.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigError(f"{where}: {name} must be an int or null, got {value!r}")
            if value is not None and value < 0:
                raise ConfigError(f"{where}: {name} must be >= 0, got {value}")
            values[name] = value
        return cls(**values)


def _owners(value: Any, where: str) -> dict[str, tuple[str, ...]]:
    """``namespaces: {ns: {owners: [tenants]}}``: each public namespace's declared owners."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: 'namespaces' must map public namespaces to "
                          "{{owners: [tenants]}}")
    out: dict[str, tuple[str, ...]] = {}
    for namespace, raw in value.items():
        check_name(namespace, "namespace")
        if not isinstance(raw, Mapping) or set(raw) - {"owners"} \
                or not isinstance(raw.get("owners"), list):
            raise ConfigError(f"{where}: namespaces.{namespace} must be {{owners: [tenants]}}")
        out[namespace] = tuple(dict.fromkeys(check_name(t, "owner") for t in raw["owners"]))
    return out


def _trust(value: Any) -> dict[str, tuple[str, ...]]:
    if not isinstance(value, Mapping):
        raise ConfigError("'trust' must map public namespaces to lists of publisher tenants")
    out: dict[str, tuple[str, ...]] = {}
    for namespace, tenants in value.items():
        check_name(namespace, "trust namespace")
        if not isinstance(tenants, list):
            raise ConfigError(f"'trust' of {namespace!r} must be a list of tenants")
        out[namespace] = tuple(dict.fromkeys(check_name(t, "trusted tenant") for t in tenants))
    return out


def _names(value: Any, what: str) -> frozenset[str]:
    if not isinstance(value, list):
        raise ConfigError(f"{what!r} must be a list")
    return frozenset(check_name(v, what) for v in value)


class AuthOptions(TypedDict, total=False):
    """:class:`Authenticator`'s keywords that every token source passes on."""

    open_metrics: bool
    open_docs: bool
    default_quota: Quota


@dataclass(slots=True)
class Authenticator:
    """Resolves ``Authorization: Bearer <token>`` headers to principals.

    Args:
        entries: the known tokens; none and ``enabled`` → every request is 401.
        enabled: False serves every caller as :meth:`Principal.trusted`.
        open_metrics: ``/metrics`` needs no token.
        open_docs: ``/docs``, ``/redoc`` and ``/openapi.json`` need no token.
    """

    entries: Iterable[TokenEntry] = ()
    enabled: bool = True
    open_metrics: bool = True
    open_docs: bool = True
    quotas: Mapping[str, Quota] = field(default_factory=dict)
    default_quota: Quota = field(default_factory=Quota)
    #: Per public namespace, its declared owners: the publishers a reader believes there
    #: when its token names none (``namespaces: {ns: {owners: [...]}}``).
    owners: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    _by_digest: dict[bytes, TokenEntry] = field(init=False, default_factory=dict)
    # Per public namespace, the tenants that may publish into it (in document order).
    _publishers: dict[str, tuple[str, ...]] = field(init=False, default_factory=dict)
    _principals: dict[bytes, Principal] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        publishers: dict[str, dict[str, None]] = {}
        for entry in self.entries:
            digest = bytes.fromhex(entry.sha256)
            if digest in self._by_digest:
                raise ConfigError("the same token is listed twice")
            self._by_digest[digest] = entry
            for namespace in sorted(entry.publish):
                publishers.setdefault(namespace, {})[entry.tenant] = None
        self._publishers = {ns: tuple(tenants) for ns, tenants in publishers.items()}
        for namespace, tenants in self.owners.items():
            strangers = [t for t in tenants if t not in self._publishers.get(namespace, ())]
            if strangers:
                raise ConfigError(
                    f"namespace {namespace!r}: owners {strangers} have no token that may "
                    f"publish there (its publishers: {list(self._publishers.get(namespace, ()))})")

    @classmethod
    def disabled(cls) -> Authenticator:
        return cls(enabled=False)

    @classmethod
    def from_document(cls, text: str, where: str, **options: Unpack[AuthOptions]
                      ) -> Authenticator:
        """An authenticator from a token document (YAML or JSON, see the module notes).

        Raises:
            ConfigError: the document is malformed.
        """
        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{where}: not YAML/JSON: {e}") from None
        if not isinstance(doc, Mapping) or not isinstance(doc.get("tokens"), list):
            raise ConfigError(f"{where}: expected a mapping with a 'tokens' list")
        entries = [
            TokenEntry.parse(raw, f"{where}: tokens[{i}]") for i, raw in enumerate(doc["tokens"])
        ]
        unknown = set(doc) - {"tokens", "tenants", "namespaces"}
        if unknown:
            raise ConfigError(f"{where}: unknown keys {sorted(unknown)}")
        owners = _owners(doc.get("namespaces") or {}, where)
        tenants = doc.get("tenants") or {}
        if not isinstance(tenants, Mapping):
            raise ConfigError(f"{where}: 'tenants' must map tenant names to quotas")
        quotas = {
            check_name(name, "tenant"): Quota.parse(raw, f"{where}: tenants.{name}")
            for name, raw in tenants.items()
        }
        return cls(entries, quotas=quotas, owners=owners, **options)

    @classmethod
    def load(
        cls,
        tokens_file: Path | None,
        *,
        environ: Mapping[str, str] | None = None,
        **options: Unpack[AuthOptions],
    ) -> Authenticator:
        """Tokens from ``tokens_file`` (a mounted Secret, say), else ``$MEMKV_TOKENS``.

        Raises:
            ConfigError: neither is given, or the document is malformed.
        """
        env = os.environ if environ is None else environ
        if tokens_file is not None:
            path = tokens_file.expanduser()
            try:
                text = path.read_text()
            except OSError as e:
                raise ConfigError(f"gateway.auth.tokens_file {path}: {e.strerror}") from None
            return cls.from_document(text, str(path), **options)
        if env.get(TOKENS_ENV):
            return cls.from_document(env[TOKENS_ENV], f"${TOKENS_ENV}", **options)
        raise ConfigError(
            "authentication is on but no tokens are configured: set gateway.auth.tokens_file "
            f"(e.g. a mounted Secret) or ${TOKENS_ENV}, or turn gateway.auth.enabled off"
        )

    def is_open(self, path: str) -> bool:
        """Whether ``path`` is served without a token."""
        # The status page is static: its figures come from /v1/stats with a token.
        if path in ("/healthz", "/readyz", "/"):
            return True
        if path == "/metrics":
            return self.open_metrics or not self.enabled
        if path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
            return self.open_docs or not self.enabled
        return not self.enabled

    def authenticate(self, authorization: str | None) -> Principal:
        """The principal of an ``Authorization`` header's value.

        Raises:
            UnauthorizedError: no bearer token, or one that names no one.
        """
        if not self.enabled:
            return Principal.trusted()
        if not authorization or not authorization[: len(_BEARER)].lower() == _BEARER:
            raise UnauthorizedError("this route needs 'Authorization: Bearer <token>'")
        token = authorization[len(_BEARER) :].strip()
        if not token or len(token) > _MAX_TOKEN_CHARS:
            raise UnauthorizedError("the bearer token is not valid")
        digest = hashlib.sha256(token.encode("utf-8")).digest()
        entry = self._by_digest.get(digest)
        # The lookup is by digest (timing tells nothing about the token); the
        # final comparison is constant-time all the same.
        if entry is None or not hmac.compare_digest(digest, bytes.fromhex(entry.sha256)):
            raise UnauthorizedError("the bearer token is not valid")
        principal = self._principals.get(digest)
        if principal is None:  # one per token: the same answer for every request
            principal = entry.principal(
                self.quotas.get(entry.tenant, self.default_quota), self.owners
            )
            self._principals[digest] = principal
        return principal


def token_document(entries: Iterable[Mapping[str, Any]]) -> str:
    """A token document (JSON, which is YAML too) of ``entries``."""
    return json.dumps({"tokens": list(entries)}, indent=2)


#: Where ``memkv up`` keeps the token it makes when none are configured.
DEV_TOKEN_FILE = "gateway-token"


def deployment_authenticator(
    settings: Any, data_dir: Path, *, environ: Mapping[str, str] | None = None
) -> tuple[Authenticator, Path | None]:
    """The authenticator of a deployment's gateway (``gateway.auth`` of its config).

    With authentication on and no tokens configured (no ``tokens_file``, no
    ``$MEMKV_TOKENS``), one token is made for tenant ``default`` with the
    ``write`` and ``admin`` roles and kept in ``<data_dir>/gateway-token``
    (mode 0600, reused on the next start), so a first ``memkv up`` is usable
    and closed to everyone who cannot read that file.

    Returns:
        The authenticator, and the dev token's file when one is in use.
    """
    # What every token source shares (Authenticator's keywords).
    options = AuthOptions(
        open_metrics=settings.open_metrics,
        open_docs=settings.open_docs,
        default_quota=Quota(settings.max_sessions_per_tenant, settings.max_bytes_per_tenant),
    )
    if not settings.enabled:
        return Authenticator(enabled=False, **options), None
    env = os.environ if environ is None else environ
    if settings.tokens_file is not None or env.get(TOKENS_ENV):
        return Authenticator.load(settings.tokens_file, environ=env, **options), None
    path = data_dir.expanduser() / DEV_TOKEN_FILE
    if path.exists():
        token = path.read_text().strip()
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        token = new_token()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
    entry = TokenEntry(hash_token(token), "default", frozenset({"write", "admin"}))
    return Authenticator([entry], **options), path
