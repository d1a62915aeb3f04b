"""Tenants: API keys mapped to tenants, and what one tenant's requests may share.

With ``SGLANG_EMBEDS_TENANTS`` (a JSON file ``{"<api key>": "<tenant>", ...}``; ``serve --tenants``)
every request but health and metrics probes must carry one of its keys (``Authorization: Bearer``),
and runs ``acting_for`` its tenant: its prefix-cache entries, handles and held rows are keyed by
the tenant, so no tenant hits, names or times another's. Without it, one space as before. The
threat model: docs/reliability.md, "Tenants".
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import secrets
from contextvars import ContextVar
from typing import Any, Iterator

from sgl_embeds_protocol import wire
from sgl_embeds_protocol.environment import setting

TENANTS_ENV = wire.TENANTS_VAR
# SGLang's own probes, open under --api-key too (sglang.srt.utils.auth.decide_request_auth)
OPEN_PREFIXES = ("/health", "/ready", "/metrics")
_CURRENT: ContextVar[str | None] = ContextVar("sgl_embeds_tenant", default=None)


def read_table(path: str | os.PathLike) -> dict[str, str]:
    """The key -> tenant table of ``path``, checked: a JSON object of non-empty strings, tenants
    without the scope separator."""
    try:
        table = json.loads(open(path).read())
    except (OSError, ValueError) as e:
        raise ValueError(f"{TENANTS_ENV}={path}: not a readable JSON file ({e})") from None
    if not isinstance(table, dict) or not table:
        raise ValueError(f"{TENANTS_ENV}={path}: must be a non-empty JSON object of api key -> tenant")
    for key, tenant in table.items():
        if not (isinstance(tenant, str) and tenant and "/" not in tenant) or not key:
            raise ValueError(f"{TENANTS_ENV}={path}: each api key must map to a non-empty tenant name "
                             f"without '/', got {tenant!r}")
    return dict(table)


@functools.cache
def key_table() -> dict[str, str] | None:
    """This server's key -> tenant table (None: no tenants). Read once: a server's tenants are
    fixed at launch."""
    path = setting(TENANTS_ENV)
    return read_table(path) if path else None


def count() -> int:
    """How many tenants this server has (1 without tenants: one space)."""
    table = key_table()
    return len(set(table.values())) if table else 1


def is_open(path: str) -> bool:
    return path.startswith(OPEN_PREFIXES)


def tenant_of(authorization: bytes | str | None, table: dict[str, str]) -> str | None:
    """The tenant of a request's ``Authorization`` header (None: no key, or not one of the
    table's). Every key is compared, in constant time, so the time does not say which matched."""
    if isinstance(authorization, bytes):
        authorization = authorization.decode("latin-1")
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not given:
        return None
    found = None
    for key, tenant in table.items():
        if secrets.compare_digest(given.encode(), key.encode()):
            found = tenant
    return found


@contextlib.contextmanager
def acting_for(tenant: str | None) -> Iterator[None]:
    """While a request of ``tenant`` is served (this task, the tasks and threads it starts)."""
    token = _CURRENT.set(tenant)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current() -> str | None:
    return _CURRENT.get()


def scoped(key: str, tenant: str | None = None) -> str:
    """``key`` (a handle, a content key) in the current (or the given) tenant's space."""
    tenant = tenant if tenant is not None else current()
    return key if tenant is None else f"{tenant}/{key}"


def extra_key(value: Any) -> Any:
    """A request's ``extra_key`` (None, a string, or a batch's list) with the current tenant
    first: the radix cache matches a prefix only under an equal extra_key."""
    tenant = current()
    if tenant is None:
        return value
    mark = "tenant:" + hashlib.sha256(tenant.encode()).hexdigest()[:16]

    def marked(v: Any) -> Any:  # anything but a string is left for SGLang to refuse
        return mark + (f"|{v}" if v else "") if v is None or isinstance(v, str) else v

    return [marked(v) for v in value] if isinstance(value, list) else marked(value)
