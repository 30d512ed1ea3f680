"""The server's tenants now: the keys file as last read (re-read on SIGHUP and when it changes, the old keys kept
where the new file has a mistake), each tenant's limits, and the usage ledger."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from tokenmill.errors import ConfigError
from tokenmill.tenants.keys import KeyRing, Tenant
from tokenmill.tenants.limits import Limiter, TenantLimits
from tokenmill.tenants.usage import UsageLedger

log = logging.getLogger(__name__)

ANONYMOUS = ""  # the tenant of every request where no keys are set: usage and stored responses go by it


class Tenancy:
    """path: the keys file (None: none); admin_keys: --api-key's; ledger: where usage is counted. ConfigError at
    once where the file cannot be read or has a mistake."""

    def __init__(self, path: Path | None, admin_keys: tuple[str, ...] = (), ledger: UsageLedger | None = None) -> None:
        self.path = path
        self.admin_keys = admin_keys
        self.ledger = ledger or UsageLedger(None)
        self.limiter = Limiter()
        self._seen = self._stamp()
        self.ring = KeyRing.of(path, admin_keys)

    @property
    def keyed(self) -> bool:
        """Whether requests must carry a key."""
        return bool(self.ring.owners)

    def authenticate(self, key: str) -> Tenant | None:
        return self.ring.authenticate(key)

    def limits(self, tenant: Tenant) -> TenantLimits:
        return self.limiter.of(tenant)

    def reload(self) -> bool:
        """Read the keys file again; where it has a mistake, the keys in force stay and the reason is logged."""
        self._seen = self._stamp()
        try:
            ring = KeyRing.of(self.path, self.admin_keys)
        except ConfigError as exc:
            log.error("the keys file was not reloaded, the keys read before stay in force: %s", exc)
            return False
        self.ring = ring
        log.info("keys reloaded from %s: %d tenants, %d keys", self.path, len(ring.tenants), len(ring.owners))
        return True

    def reload_if_changed(self) -> None:
        if self.path is not None and self._stamp() != self._seen:
            self.reload()

    def _stamp(self) -> tuple[int, int, int] | None:
        """What tells a changed file: its inode (an editor's save replaces it), size and modification time."""
        if self.path is None:
            return None
        try:
            stat = os.stat(self.path)
        except OSError:
            return None
        return stat.st_ino, stat.st_size, stat.st_mtime_ns
