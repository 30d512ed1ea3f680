"""Stored Responses (OpenAI's Responses API): what `previous_response_id` continues and GET/DELETE
/v1/responses/{id} read. One SQLite file, so a conversation survives a restart; the newest `max_responses` are kept.

Each row holds the response object, the items its request added to the conversation (input) and what the model
answered (output), and the response it continued: a conversation is rebuilt by walking that chain, so a long one
costs its length once, not once per turn.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path
from typing import Any

from tokenmill.errors import RequestError

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    previous_id TEXT,
    body TEXT NOT NULL,
    input_items TEXT NOT NULL,
    output_items TEXT NOT NULL
)
"""


class ResponseStore:
    def __init__(self, path: Path, max_responses: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.max_responses = max_responses
        self._lock = threading.Lock()  # one connection, used from the event loop and worker threads
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(_SCHEMA)

    def put(self, response: dict[str, Any], input_items: list[dict[str, Any]]) -> None:
        """Keep a finished response; the oldest beyond max_responses go."""
        row = (response["id"], response.get("previous_response_id"), json.dumps(response),
               json.dumps(input_items), json.dumps(response["output"]))
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO responses (id, previous_id, body, input_items, output_items) "
                             "VALUES (?, ?, ?, ?, ?)", row)
            self._db.execute("DELETE FROM responses WHERE seq <= (SELECT MAX(seq) FROM responses) - ?",
                             (self.max_responses,))

    def get(self, response_id: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute("SELECT body FROM responses WHERE id = ?", (response_id,)).fetchone()
        return None if row is None else json.loads(row[0])

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0

    def conversation(self, response_id: str) -> list[dict[str, Any]]:
        """Every item of the conversation up to and including this response's output, oldest first."""
        turns: list[tuple[str, str]] = []
        at: str | None = response_id
        with self._lock:
            while at is not None:
                row = self._db.execute("SELECT previous_id, input_items, output_items FROM responses WHERE id = ?",
                                       (at,)).fetchone()
                if row is None:
                    what = "" if at == response_id else f" (it continues {at}, which is no longer stored)"
                    raise RequestError(f"Previous response with id '{response_id}' not found{what}.",
                                       param="previous_response_id")
                at, input_items, output_items = row
                turns.append((input_items, output_items))
        return [item for input_items, output_items in reversed(turns)
                for item in json.loads(input_items) + json.loads(output_items)]

    def close(self) -> None:
        with self._lock:
            self._db.close()
