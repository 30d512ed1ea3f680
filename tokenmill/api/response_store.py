"""Stored Responses (OpenAI's Responses API): what `previous_response_id` continues, GET/DELETE
/v1/responses/{id} and GET /v1/responses/{id}/input_items read. One SQLite file, so a conversation survives a
restart; the newest `max_responses` are kept.

Each row holds the response object, the items its request added to the conversation (input) and what the model
answered (output), and the response it continued: a conversation is rebuilt by walking that chain, so a long one
costs its length once, not once per turn. Each response is its tenant's (tenants/; "" where the server has no keys):
another tenant's id is not found, and a conversation walks only its tenant's responses.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from pathlib import Path
from typing import Any

from tokenmill.config import ServerConfig
from tokenmill.errors import ConfigError, NotFoundError
from tokenmill.loader.sources import cache_dir

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    previous_id TEXT,
    body TEXT NOT NULL,
    input_items TEXT NOT NULL,
    output_items TEXT NOT NULL,
    tenant TEXT NOT NULL DEFAULT ''
)
"""


def open_store(config: ServerConfig) -> ResponseStore | None:
    """The store the settings name (None: --responses-store off); ConfigError where it cannot be one."""
    if config.responses_store == "off":
        return None
    path = Path(config.responses_store) if config.responses_store else cache_dir() / "responses.sqlite3"
    return ResponseStore(path, config.responses_store_max)


class ResponseStore:
    def __init__(self, path: Path, max_responses: int) -> None:
        """ConfigError, naming the path, where it cannot be opened as a store: a directory, a file that is not
        SQLite, a path that cannot be created or written."""
        self.path = path
        self.max_responses = max_responses
        self._lock = threading.Lock()  # one connection, used from the event loop and worker threads
        if path.is_dir():  # SQLite would say only "unable to open database file"
            raise ConfigError(f"--responses-store {path}: a directory, not a file")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--responses-store {path}: cannot make its folder: {exc}") from exc
        try:
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")  # the first read: a file that is not SQLite fails here
            self._db.execute(_SCHEMA)
            columns = {row[1] for row in self._db.execute("PRAGMA table_info(responses)")}
            if "tenant" not in columns:  # a store from before tenants: its responses are the key-less server's
                self._db.execute("ALTER TABLE responses ADD COLUMN tenant TEXT NOT NULL DEFAULT ''")
            # a write of what is there, so that a file that cannot be written is refused now, not at each response
            self._db.execute(f"PRAGMA user_version = {self._db.execute('PRAGMA user_version').fetchone()[0]}")
        except sqlite3.Error as exc:
            raise ConfigError(f"--responses-store {path}: cannot open it as an SQLite file: {exc}") from exc

    def put(self, response: dict[str, Any], input_items: list[dict[str, Any]], tenant: str = "") -> bool:
        """Keep a finished response; the oldest beyond max_responses go. False where it could not be kept (a full
        disk, a file made read-only): logged, and the client is told (store: false), never a silent loss."""
        row = (response["id"], response.get("previous_response_id"), json.dumps(response),
               json.dumps(input_items), json.dumps(response["output"]), tenant)
        with self._lock:
            try:  # one transaction: a response is kept whole, with the bound, or not at all
                self._db.execute("BEGIN IMMEDIATE")
                self._db.execute("INSERT OR REPLACE INTO responses (id, previous_id, body, input_items, "
                                 "output_items, tenant) VALUES (?, ?, ?, ?, ?, ?)", row)
                self._db.execute("DELETE FROM responses WHERE seq <= (SELECT MAX(seq) FROM responses) - ?",
                                 (self.max_responses,))
                self._db.execute("COMMIT")
            except sqlite3.Error as exc:
                self._db.rollback()
                log.error("response %s not stored in %s (%s): answered with store false", response["id"],
                          self.path, exc)
                return False
        return True

    def get(self, response_id: str, tenant: str = "") -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute("SELECT body FROM responses WHERE id = ? AND tenant = ?",
                                   (response_id, tenant)).fetchone()
        return None if row is None else json.loads(row[0])

    def delete(self, response_id: str, tenant: str = "") -> bool:
        with self._lock:
            return self._db.execute("DELETE FROM responses WHERE id = ? AND tenant = ?",
                                    (response_id, tenant)).rowcount > 0

    def conversation(self, response_id: str, tenant: str = "") -> list[dict[str, Any]]:
        """Every item of the conversation up to and including this response's output, oldest first."""
        turns, missing = self._chain(response_id, tenant)
        if missing is not None:
            what = f" (it continues {missing}, which is no longer stored)" if turns else ""
            raise NotFoundError(f"Previous response with id '{response_id}' not found{what}.",
                                param="previous_response_id", code="previous_response_not_found")
        return [item for _, input_items, output_items in turns for item in input_items + output_items]

    def input_items(self, response_id: str, tenant: str = "") -> list[tuple[str, list[dict[str, Any]]]] | None:
        """The items this response's model read, oldest first, with the id of the response each came with: the
        conversation before it (as far back as it is still stored), then its own input. None if the response is not
        stored."""
        turns, _ = self._chain(response_id, tenant)
        if not turns:
            return None
        return [(turn_id, input_items + output_items) for turn_id, input_items, output_items in turns[:-1]] + \
            [(turns[-1][0], turns[-1][1])]

    def _chain(self, response_id: str, tenant: str) -> tuple[list[tuple[str, list, list]], str | None]:
        """The (id, input items, output items) of each turn up to this response, oldest first, walking back from it
        while the responses it continues are stored; and the id of the first one that is not (None: none)."""
        turns: list[tuple[str, list, list]] = []
        at: str | None = response_id
        with self._lock:
            while at is not None:
                row = self._db.execute("SELECT previous_id, input_items, output_items FROM responses WHERE id = ? "
                                       "AND tenant = ?", (at, tenant)).fetchone()
                if row is None:
                    break
                turn_id, (at, input_items, output_items) = at, row
                turns.append((turn_id, json.loads(input_items), json.loads(output_items)))
        return turns[::-1], at

    def close(self) -> None:
        with self._lock:
            self._db.close()
