"""Usage by tenant and model: prompt, completion and cached tokens and requests, per minute, kept in SQLite (the
Responses store's file, a table of its own) so that it survives a restart.

Finished sequences are recorded from the engine thread into memory; the server writes them out once a second and
when it stops, so a crash loses at most the last second."""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

from tokenmill.errors import ConfigError

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    tenant TEXT NOT NULL,
    model TEXT NOT NULL,
    minute INTEGER NOT NULL,
    prompt_tokens INTEGER NOT NULL DEFAULT 0,
    completion_tokens INTEGER NOT NULL DEFAULT 0,
    cached_tokens INTEGER NOT NULL DEFAULT 0,
    requests INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, model, minute)
)
"""
BUCKET_WIDTHS = {"1m": 60, "1h": 3600, "1d": 86400}
KEPT_IN_MEMORY = 31 * 86400  # seconds of usage a ledger without a file keeps


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    requests: int = 0

    def add(self, other: Usage) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


_COLUMNS = tuple(f.name for f in fields(Usage))


class UsageLedger:
    """path: the SQLite file (None: kept in memory only, lost at a restart)."""

    def __init__(self, path: Path | None, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, str, int], Usage] = {}
        self._totals: dict[tuple[str, str], Usage] = {}
        self._db: sqlite3.Connection | None = None
        self._db_lock = threading.Lock()
        if path is None:
            return
        try:
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=10)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(_SCHEMA)
            rows = self._db.execute(f"SELECT tenant, model, {', '.join(f'SUM({c})' for c in _COLUMNS)} FROM usage "
                                    "GROUP BY tenant, model").fetchall()
        except sqlite3.Error as exc:
            raise ConfigError(f"--responses-store {path}: cannot keep usage in it: {exc}") from exc
        self._totals = {(tenant, model): Usage(*counts) for tenant, model, *counts in rows}

    def record(self, tenant: str, model: str, usage: Usage) -> None:
        """Count a finished sequence's usage (any thread)."""
        minute = int(self.clock() // 60)
        with self._lock:
            self._pending.setdefault((tenant, model, minute), Usage()).add(usage)
            self._totals.setdefault((tenant, model), Usage()).add(usage)

    def totals(self) -> dict[tuple[str, str], Usage]:
        """Every (tenant, model)'s usage since the store began: what /metrics counts."""
        with self._lock:
            return {key: Usage(**vars(usage)) for key, usage in self._totals.items()}

    def flush(self) -> None:
        """Write what was recorded since the last flush (kept in memory where there is no file)."""
        if self._db is None:
            oldest = int((self.clock() - KEPT_IN_MEMORY) // 60)
            with self._lock:
                self._pending = {key: usage for key, usage in self._pending.items() if key[2] >= oldest}
            return
        with self._lock:
            pending, self._pending = self._pending, {}
        if not pending:
            return
        rows = [(*key, *(getattr(u, c) for c in _COLUMNS)) for key, u in pending.items()]
        sets = ", ".join(f"{c} = {c} + excluded.{c}" for c in _COLUMNS)
        with self._db_lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                self._db.executemany(f"INSERT INTO usage (tenant, model, minute, {', '.join(_COLUMNS)}) VALUES "
                                     f"(?, ?, ?, ?, ?, ?, ?) ON CONFLICT (tenant, model, minute) DO UPDATE SET "
                                     f"{sets}", rows)
                self._db.execute("COMMIT")
            except sqlite3.Error as exc:  # a full disk, a file made read-only: kept for the next flush
                self._db.rollback()
                log.error("usage not written (%s): kept in memory, tried again next time", exc)
                with self._lock:
                    for key, usage in pending.items():
                        self._pending.setdefault(key, Usage()).add(usage)

    def buckets(self, start: int, end: int, width: int, tenant: str | None = None
                ) -> list[tuple[int, list[tuple[str, str, Usage]]]]:
        """Usage from `start` to `end` (Unix seconds, end excluded) in buckets of `width` seconds, each with its
        (tenant, model, usage) rows; only `tenant`'s where given."""
        self.flush()
        rows: dict[tuple[int, str, str], Usage] = {}

        def add(bucket_tenant: str, model: str, minute: int, usage: Usage) -> None:
            at = minute * 60
            if start <= at < end and (tenant is None or bucket_tenant == tenant):
                bucket = start + (at - start) // width * width
                rows.setdefault((bucket, bucket_tenant, model), Usage()).add(usage)

        if self._db is not None:
            with self._db_lock:
                stored = self._db.execute(f"SELECT tenant, model, minute, {', '.join(_COLUMNS)} FROM usage WHERE "
                                          "minute >= ? AND minute < ?", (start // 60, -(-end // 60))).fetchall()
            for row_tenant, model, minute, *counts in stored:
                add(row_tenant, model, minute, Usage(*counts))
        else:
            with self._lock:
                for (row_tenant, model, minute), usage in self._pending.items():
                    add(row_tenant, model, minute, usage)
        out: dict[int, list[tuple[str, str, Usage]]] = {b: [] for b in range(start, end, width)}
        for (bucket, row_tenant, model), usage in sorted(rows.items()):
            out.setdefault(bucket, []).append((row_tenant, model, usage))
        return sorted(out.items())

    def close(self) -> None:
        if self._db is not None:
            self.flush()
            with self._db_lock:
                self._db.close()
            self._db = None
