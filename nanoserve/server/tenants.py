"""Tenants: each API key is a tenant, and what the server keeps apart between tenants.

Owns: `Tenant` (a name and its key), reading keys from `--api-key` (named `api-key-1`, ...) and
from a keys file (`name key` a line; blank lines and `#` comments skipped), refusing an empty,
duplicate or non-printable key (or a duplicate name) naming where it came from and never
echoing the key, finding the tenant of a bearer token in constant time (`hmac.compare_digest`
against every key, whichever matches), and `Tenancy`, what the server does with them:
- the prefix cache's scope: `tenant` (the default with more than one key) salts every block of
  a tenant's request with its tenant, on top of the request's own `cache_salt`, so no tenant's
  cached prefix shows in another's `cached_tokens` or timing; `shared` is one cache for all;
- the fair share's parent: with more than one tenant, every sequence of a tenant shares one
  parent, so a client cannot escape its share by splitting work over many HTTP requests
  (one key or none: each HTTP request is its own parent, as without tenants);
- `max_concurrent` generation requests per tenant in flight: past it, a 429 with Retry-After;
- re-reading the keys file (on SIGHUP): a file that no longer reads keeps the keys in use.
Refuses: HTTP (routes check the header), and knowing the engine.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from nanoserve.sampling_params import SamplingParams

log = logging.getLogger("nanoserve.server")
CacheScope = Literal["tenant", "shared"]
CACHE_SCOPES: tuple[CacheScope, ...] = ("tenant", "shared")


class TenancyError(ValueError):
    """A key, keys file or tenant option that cannot be served; the message names which."""


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    key: str = field(repr=False)
    source: str = field(default="", compare=False)  # where it was given, for error messages

    @property
    def parent_id(self) -> str:
        """The fair share's parent of all this tenant's sequences (request ids never start so)."""
        return f"tenant:{self.name}"


def tenants_from_options(keys: list[str], option: str = "--api-key") -> list[Tenant]:
    """Keys given on the command line, named by position (`api-key-1`, ...)."""
    tenants = []
    for position, key in enumerate(keys, start=1):
        where = f"{option} number {position}" if len(keys) > 1 else option
        _check_key(key, where)
        tenants.append(Tenant(f"api-key-{position}", key, where))
    return tenants


def read_keys_file(path: Path) -> list[Tenant]:
    """The tenants of a keys file: `name key` a line."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise TenancyError(f"--api-keys-file {path}: cannot be read ({error})") from None
    tenants = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"--api-keys-file {path} line {number}"
        fields = line.split()
        if len(fields) != 2:
            raise TenancyError(f"{where}: expected 'name key' (two fields), got {len(fields)}")
        name, key = fields
        _check_name(name, where)
        _check_key(key, f"{where} (tenant {name!r})")
        tenants.append(Tenant(name, key, where))
    if not tenants:
        raise TenancyError(f"--api-keys-file {path}: holds no keys")
    return tenants


def check_distinct(tenants: list[Tenant]) -> None:
    """Refuse two tenants of one name or one key (which tenant would the key be?)."""
    names: set[str] = set()
    for index, tenant in enumerate(tenants):
        if tenant.name in names:
            raise TenancyError(f"{tenant.source}: the tenant name {tenant.name!r} is given twice")
        names.add(tenant.name)
        for earlier in tenants[:index]:
            if hmac.compare_digest(tenant.key.encode(), earlier.key.encode()):
                raise TenancyError(f"{tenant.source}: the key of tenant {tenant.name!r} is also the key of "
                                   f"tenant {earlier.name!r} ({earlier.source}): each key must be its own")


def _check_key(key: str, where: str) -> None:
    """An empty key would leave the server open while the operator thinks it is guarded; one no
    client can send exactly (surrounding spaces, which HTTP strips from a header value, or
    characters outside printable ASCII) would lock its tenant out."""
    if not key.strip():
        raise TenancyError(f"{where}: the key must not be empty; leave it unset for no key")
    if key != key.strip():
        raise TenancyError(f"{where}: the key must not start or end with whitespace: HTTP drops it "
                               "from the Authorization header, so no client could send the key as given")
    if not (key.isascii() and key.isprintable()) or " " in key:
        raise TenancyError(f"{where}: the key must be printable ASCII without spaces (as a bearer "
                               "token is): clients send the Authorization header as ASCII")


def _check_name(name: str, where: str) -> None:
    if not (name.isascii() and name.isprintable()):
        raise TenancyError(f"{where}: the tenant name must be printable ASCII (it labels /metrics)")


def find_tenant(tenants: tuple[Tenant, ...], given: str) -> Tenant | None:
    """The tenant whose key is `given`: every key is compared in constant time, and all of them
    whatever matches, so neither the time nor the order says how close a guess came."""
    found = None
    for tenant in tenants:
        if hmac.compare_digest(given.encode(), tenant.key.encode()):
            found = tenant
    return found


@dataclass(slots=True)
class Tenancy:
    """The server's tenants and what it keeps apart between them. Event loop only."""

    option_tenants: tuple[Tenant, ...] = ()
    keys_file: Path | None = None
    cache_scope: CacheScope | None = None  # None: `tenant` with more than one key, else `shared`
    max_concurrent: int | None = None  # generation requests per tenant in flight
    tenants: tuple[Tenant, ...] = ()
    in_flight: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        if self.cache_scope is not None and self.cache_scope not in CACHE_SCOPES:
            raise TenancyError(f"--prefix-cache-scope must be one of {', '.join(CACHE_SCOPES)}; "
                                   f"got {self.cache_scope!r}")
        if self.max_concurrent is not None and self.max_concurrent < 1:
            raise TenancyError("--max-concurrent-requests-per-tenant must be >= 1; got "
                               f"{self.max_concurrent}")
        self.tenants = self._read()
        for option, value in (("--max-concurrent-requests-per-tenant", self.max_concurrent),
                              ("--prefix-cache-scope", self.cache_scope)):
            if value is not None and not self.tenants:
                raise TenancyError(f"{option} needs --api-key or --api-keys-file: without keys there are "
                                   "no tenants")

    def _read(self) -> tuple[Tenant, ...]:
        tenants = [*self.option_tenants, *(read_keys_file(self.keys_file) if self.keys_file else [])]
        check_distinct(tenants)
        return tuple(tenants)

    def reload(self) -> bool:
        """Re-read the keys file (SIGHUP); a file that no longer reads keeps the keys in use."""
        if self.keys_file is None:
            return False
        try:
            self.tenants = self._read()
        except TenancyError as error:
            log.error("keeping the %d keys in use: %s", len(self.tenants), error)
            return False
        log.info("reloaded %s: %d keys", self.keys_file, len(self.tenants))
        return True

    @property
    def guarded(self) -> bool:
        return bool(self.tenants)

    @property
    def scope(self) -> CacheScope:
        if self.cache_scope is not None:
            return self.cache_scope
        return "tenant" if len(self.tenants) > 1 else "shared"

    def find(self, given: str) -> Tenant | None:
        return find_tenant(self.tenants, given)

    def parent_id(self, tenant: Tenant | None, request_id: str) -> str:
        """The fair share's parent of a request's sequences: its tenant's, with tenants to tell
        apart; else the request's own."""
        return tenant.parent_id if tenant is not None and len(self.tenants) > 1 else request_id

    def scoped_params(self, params: SamplingParams, tenant: Tenant | None) -> SamplingParams:
        """The params with the tenant's cache scope applied: in `tenant` scope the salt is the
        tenant's name and then the request's own salt, so two tenants sending one salt still
        share nothing."""
        if tenant is None or self.scope == "shared":
            return params
        return dataclasses.replace(params, cache_salt=f"tenant\0{tenant.name}\0{params.cache_salt or ''}")

    def has_room(self, tenant: Tenant | None) -> bool:
        limit = self.max_concurrent
        return tenant is None or limit is None or self.in_flight[tenant.name] < limit

    def enter(self, tenant: Tenant | None) -> None:
        if tenant is not None:
            self.in_flight[tenant.name] += 1

    def leave(self, tenant: Tenant | None) -> None:
        if tenant is not None:
            self.in_flight[tenant.name] -= 1
