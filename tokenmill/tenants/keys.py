"""The keys file (`--api-keys FILE`, TOML): the tenants, their limits, and the hashes of their keys.

    [tenants.alice]
    role = "user"                    # or "admin": /metrics, /stats, every tenant's usage, LoRA loading
    requests_per_minute = 60
    tokens_per_minute = 200000       # prompt + completion
    max_concurrent_requests = 8
    max_tokens = 2048                # the most one request may generate (and its default)
    models = ["smollm2-135m"]        # the models it may use (default: all)
    weight = 2.0                     # its fair share of the engine against the others'
    cache_group = "team-a"           # tenants of one group share prefix-cache KV (default: its own name)

    [[keys]]                         # `tokenmill keys add alice --file FILE` appends one
    tenant = "alice"
    sha256 = "…"                     # the key's SHA-256, hex; the key itself is never stored
    created = "2026-11-29"

A key is 32 random bytes (`tm-` and 43 URL-safe characters), so a plain SHA-256 of it is as good as a salted, slow
hash: nobody can guess one from its hash.
"""

from __future__ import annotations

import datetime
import hashlib
import re
import secrets
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from tokenmill.errors import ConfigError

ROLES = ("user", "admin")
ADMIN_TENANT = "admin"  # the tenant of --api-key's keys
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_HASH = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Tenant:
    """Who a key belongs to, and what it may do; a limit of None is no limit."""

    name: str
    role: str = "user"
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None
    max_tokens: int | None = None
    models: tuple[str, ...] | None = None
    weight: float = 1.0
    cache_group: str | None = None

    @property
    def admin(self) -> bool:
        return self.role == "admin"

    @property
    def cache_namespace(self) -> str:
        return self.cache_group or self.name

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models


_LIMITS = ("requests_per_minute", "tokens_per_minute", "max_concurrent_requests", "max_tokens")
_FIELDS = {f.name for f in fields(Tenant)} - {"name"}


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return "tm-" + secrets.token_urlsafe(32)


@dataclass(frozen=True)
class KeyRing:
    """The tenants and which key hash belongs to whom; immutable, so a reload swaps the whole ring at once."""

    tenants: dict[str, Tenant]
    owners: dict[str, str]  # key hash -> tenant name

    def authenticate(self, key: str) -> Tenant | None:
        name = self.owners.get(hash_key(key))
        return None if name is None else self.tenants[name]

    @classmethod
    def of(cls, path: Path | None, admin_keys: tuple[str, ...] = ()) -> KeyRing:
        """The ring of the keys file (None: none) and of --api-key's keys, which are one admin tenant's;
        ConfigError naming the file and line of the first mistake."""
        tenants, owners = read_keys_file(path) if path is not None else ({}, {})
        if admin_keys:
            if ADMIN_TENANT in tenants:
                raise ConfigError(f"{path}: tenants.{ADMIN_TENANT} is the name of --api-key's tenant; "
                                  "choose another")
            tenants[ADMIN_TENANT] = Tenant(ADMIN_TENANT, role="admin")
            owners.update({hash_key(k): ADMIN_TENANT for k in admin_keys})
        return cls(tenants, owners)


def read_keys_file(path: Path) -> tuple[dict[str, Tenant], dict[str, str]]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"--api-keys {path}: cannot read it: {exc.strerror}") from exc
    return parse_keys(text, path)


def parse_keys(text: str, path: Path) -> tuple[dict[str, Tenant], dict[str, str]]:
    """The tenants of a keys file's text and who owns each key hash; ConfigError with the line of a mistake."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not TOML: {exc}") from exc
    where = _Locator(path, text)
    unknown = set(data) - {"tenants", "keys"}
    if unknown:
        name = sorted(unknown)[0]
        raise where.error(f"unknown table or key {name!r}: the file holds [tenants.NAME] tables and [[keys]]",
                          rf"\[+\s*{re.escape(name)}[\].\s]|{re.escape(name)}\s*=")
    tables = data.get("tenants", {})
    if not isinstance(tables, dict):
        raise where.error("tenants: a table of tables, [tenants.NAME]", r"tenants\s*=")
    tenants = {name: _tenant(name, table, where) for name, table in tables.items()}
    owners: dict[str, str] = {}
    entries = data.get("keys", [])
    if not isinstance(entries, list):
        raise where.error("keys: an array of tables, [[keys]]", r"keys\s*=")
    # [[keys]] tables, each on lines of its own; or an inline array, `keys = [...]`, all on its line
    keys_header = r"\[\[\s*keys\s*\]\]"
    inline = not any(re.match(rf"\s*{keys_header}", line) for line in where.lines)
    for i, entry in enumerate(entries):
        def fault(message: str, i: int = i) -> ConfigError:
            return where.error(f"keys entry {i + 1}: {message}", r"keys\s*=" if inline else keys_header,
                               nth=0 if inline else i)
        if not isinstance(entry, dict):
            raise fault("a table")
        if extra := set(entry) - {"tenant", "sha256", "created", "label"}:
            raise fault(f"unknown field {sorted(extra)[0]!r} (tenant, sha256, created, label)")
        tenant, digest = entry.get("tenant"), entry.get("sha256")
        if not isinstance(tenant, str) or tenant not in tenants:
            raise fault(f"tenant {tenant!r} has no [tenants.{tenant}] table")
        if not isinstance(digest, str) or not _HASH.fullmatch(digest):
            raise fault("sha256: the key's SHA-256 as 64 lowercase hex digits (tokenmill keys add writes it)")
        if owners.get(digest, tenant) != tenant:
            raise fault(f"the same key hash is also {owners[digest]}'s")
        owners[digest] = tenant
    return tenants, owners


def _tenant(name: str, table: Any, where: _Locator) -> Tenant:
    header = rf"\[\s*tenants\.(?:{re.escape(name)}|\"{re.escape(name)}\"|'{re.escape(name)}')\s*\]"

    def fault(message: str, key: str | None = None) -> ConfigError:
        return where.error(f"tenants.{name}{'.' + key if key else ''}: {message}", header, key=key)

    if not _NAME.fullmatch(name):
        raise fault("a tenant's name is 1 to 64 letters, digits, '_', '.' or '-'")
    if not isinstance(table, dict):  # `NAME = ...` under [tenants]
        raise where.error(f"tenants.{name}: a table, [tenants.{name}]", r"\[\s*tenants\s*\]", key=name)
    if extra := set(table) - _FIELDS:
        raise fault(f"unknown setting (known: {', '.join(sorted(_FIELDS))})", sorted(extra)[0])
    for key in _LIMITS:
        value = table.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise fault("a whole number, at least 1 (leave it out for no limit)", key)
    role = table.get("role", "user")
    if role not in ROLES:
        raise fault(f"{role!r}: user or admin", "role")
    weight = table.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight <= 1000:
        raise fault("a number above 0, at most 1000", "weight")
    models = table.get("models")
    if models is not None and (not isinstance(models, list) or not all(isinstance(m, str) for m in models)):
        raise fault("a list of model names", "models")
    group = table.get("cache_group")
    if group is not None and (not isinstance(group, str) or not _NAME.fullmatch(group)):
        raise fault("1 to 64 letters, digits, '_', '.' or '-'", "cache_group")
    return Tenant(name, role, table.get("requests_per_minute"), table.get("tokens_per_minute"),
                  table.get("max_concurrent_requests"), table.get("max_tokens"),
                  tuple(models) if models is not None else None, float(weight), group)


class _Locator:
    """The line a mistake is on, found in the text (tomllib gives lines for syntax errors only)."""

    def __init__(self, path: Path, text: str) -> None:
        self.path = path
        self.lines = text.splitlines()

    def error(self, message: str, header: str, key: str | None = None, nth: int = 0) -> ConfigError:
        line = self._find(header, key, nth)
        return ConfigError(f"{self.path}{f', line {line}' if line else ''}: {message}")

    def _find(self, header: str, key: str | None, nth: int) -> int | None:
        starts = [i for i, line in enumerate(self.lines) if re.match(rf"\s*(?:{header})", line)]
        if len(starts) <= nth:
            return None
        start = starts[nth]
        if key is None:
            return start + 1
        for i in range(start + 1, len(self.lines)):
            if re.match(r"\s*\[", self.lines[i]):
                break
            if re.match(rf"\s*\"?{re.escape(key)}\"?\s*=", self.lines[i]):
                return i + 1
        return start + 1


def add_key(path: Path, tenant: str, role: str = "user") -> str:
    """A new key for `tenant`, its hash appended to the file (a [tenants.NAME] table first, where it has none):
    the key, to be shown once."""
    tenants, _ = read_keys_file(path) if path.exists() else ({}, {})
    if not _NAME.fullmatch(tenant):
        raise ConfigError(f"{tenant!r}: a tenant's name is 1 to 64 letters, digits, '_', '.' or '-'")
    if tenant == ADMIN_TENANT:
        raise ConfigError(f"{ADMIN_TENANT!r} is the name of --api-key's tenant; choose another")
    key = new_key()
    text = path.read_text() if path.exists() else ""
    added = f'\n[tenants.{tenant}]\nrole = "{role}"\n' if tenant not in tenants else ""
    added += (f'\n[[keys]]\ntenant = "{tenant}"\nsha256 = "{hash_key(key)}"\n'
              f'created = "{datetime.date.today().isoformat()}"\n')
    parse_keys(text + added, path)  # what is written reads back
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as file:
        file.write(added)
    return key
