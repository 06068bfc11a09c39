"""Tenants and their keys: who sent a request, what it may use, and its cache salt.

`pdserve serve --api-keys-file FILE` names tenants (`KeysFile`): each with its keys,
optional limits and the served model names it may use. `--api-key` (or
`PDSERVE_API_KEY`) is one tenant, `default`; with no key at all every client is the
anonymous `default` tenant. `--admin-api-key` opens the operator endpoints, which no
tenant key opens.

A presented key is found by comparing its sha256 with every known key's sha256 with
`hmac.compare_digest`, all of them, without stopping at a match: the time taken says
neither which key matched nor how much of one. Keys appear in no repr and no log line.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import msgspec

DEFAULT_TENANT = "default"
# A tenant's name is a Prometheus label value and shows in logs: plain characters only.
TenantName = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[\w.-]+$")]
ApiKey = Annotated[str, msgspec.Meta(min_length=1, max_length=512, pattern=r"^\S+$")]
Positive = Annotated[int, msgspec.Meta(ge=1)]


class TenantEntry(msgspec.Struct, forbid_unknown_fields=True):
    """One tenant of the keys file. A limit left out is no limit; `models` left out is
    every served model name."""

    name: TenantName
    keys: Annotated[list[ApiKey], msgspec.Meta(min_length=1)]
    requests_per_minute: Positive | None = None
    tokens_per_minute: Positive | None = None  # usage.total_tokens, reserved at admission
    max_concurrent_requests: Positive | None = None
    max_tokens_per_request: Positive | None = None  # caps max_tokens and its default
    models: list[str] | None = None


class KeysFile(msgspec.Struct, forbid_unknown_fields=True):
    tenants: Annotated[list[TenantEntry], msgspec.Meta(min_length=1)]


class TenantsError(ValueError):
    """A keys file or key flags that cannot be served; the message is one line."""


@dataclass(frozen=True)
class Tenant:
    name: str
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None
    max_tokens_per_request: int | None = None
    models: frozenset[str] | None = None  # None: every served model name

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models

    @classmethod
    def from_entry(cls, entry: TenantEntry) -> Tenant:
        return cls(
            name=entry.name,
            requests_per_minute=entry.requests_per_minute,
            tokens_per_minute=entry.tokens_per_minute,
            max_concurrent_requests=entry.max_concurrent_requests,
            max_tokens_per_request=entry.max_tokens_per_request,
            models=None if entry.models is None else frozenset(entry.models),
        )


ANONYMOUS = Tenant(DEFAULT_TENANT)  # every client, when no key is configured


def read_keys_file(path: str) -> KeysFile:
    """The file decoded and checked field by field (raises TenantsError, one line)."""
    try:
        data = Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise TenantsError(f"--api-keys-file {path}: {exc.strerror or exc}") from None
    try:
        return msgspec.json.decode(data, type=KeysFile)
    except msgspec.DecodeError as exc:  # msgspec names the field: "... - at `$.tenants[0]`"
        raise TenantsError(f"--api-keys-file {path}: {exc}") from None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class KeyBook:
    """Every configured key by its digest: tenant keys and the admin key."""

    tenants: tuple[Tenant, ...]
    _by_digest: tuple[tuple[bytes, Tenant], ...] = field(repr=False)
    _admin: bytes | None = field(default=None, repr=False)

    @classmethod
    def build(
        cls,
        served_models: list[str],
        api_keys: KeysFile | None = None,
        api_key: str | None = None,
        admin_api_key: str | None = None,
    ) -> KeyBook:
        """Raises TenantsError for duplicate names or keys, unknown model names, a key
        given twice, or both a keys file and a single key."""
        if api_keys is not None and api_key:
            raise TenantsError("give either --api-keys-file or --api-key (PDSERVE_API_KEY)")
        entries = list(api_keys.tenants) if api_keys is not None else []
        if api_key:
            entries = [TenantEntry(DEFAULT_TENANT, [api_key])]
        names: set[str] = set()
        keys: dict[bytes, Tenant] = {}
        for entry in entries:
            if entry.name in names:
                raise TenantsError(f"tenant {entry.name!r} is named twice")
            names.add(entry.name)
            unknown = sorted(set(entry.models or ()) - set(served_models))
            if unknown:
                raise TenantsError(
                    f"tenant {entry.name!r}: model {unknown[0]!r} is not served "
                    f"(served: {', '.join(served_models)})"
                )
            tenant = Tenant.from_entry(entry)
            for key in entry.keys:
                if keys.setdefault(_digest(key), tenant) is not tenant:
                    raise TenantsError(f"tenant {entry.name!r}: a key is given twice")
        admin = _digest(admin_api_key) if admin_api_key else None
        if admin is not None and admin in keys:
            raise TenantsError("the admin key is also a tenant's key")
        tenants = tuple({t.name: t for t in keys.values()}.values())
        return cls(tenants, tuple(keys.items()), admin)

    @property
    def tenant_keys(self) -> bool:
        """Whether the API needs a tenant's key (else every client is ANONYMOUS)."""
        return bool(self._by_digest)

    @property
    def any_keys(self) -> bool:
        return self.tenant_keys or self._admin is not None

    def tenant_for(self, key: str) -> Tenant | None:
        digest = _digest(key)
        found = None
        for known, tenant in self._by_digest:  # no early exit: same time for every key
            if hmac.compare_digest(digest, known):
                found = tenant
        return found

    def is_admin(self, key: str) -> bool:
        return self._admin is not None and hmac.compare_digest(_digest(key), self._admin)


def tenant_cache_salt(key: bytes, tenant: str, cache_salt: str | None) -> str:
    """The salt of every block hash of a request: HMAC(the deployment's salt key
    (`common/wire_auth.py:salt_key`), tenant, the
    request's own `cache_salt`). Two tenants never share a block, a `cache_salt` only
    narrows sharing within its tenant, and without the secret nobody can forge another
    tenant's salt. The JSON pair keeps ("ab", "c") and ("a", "bc") apart."""
    message = msgspec.json.encode([tenant, cache_salt or ""])
    return hmac.new(key, message, hashlib.sha256).hexdigest()
