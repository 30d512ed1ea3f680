"""The Responses store: rows survive reopening the file, the oldest go beyond the bound, and a conversation is
rebuilt along its chain of previous responses, as are the input items a response read; a path that cannot be a
store is refused at start in one line, and a write that fails leaves nothing behind and says so."""

from __future__ import annotations

import os
import sqlite3
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tokenmill.api.response_store import ResponseStore, open_store
from tokenmill.api.responses_api import listed_items
from tokenmill.cli import main
from tokenmill.config import ServerConfig
from tokenmill.errors import ConfigError, RequestError


def response(rid: str, previous: str | None, text: str) -> dict:
    return {"id": rid, "object": "response", "previous_response_id": previous,
            "output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}]}


def user(text: str) -> dict:
    return {"type": "message", "role": "user", "content": text}


def test_a_conversation_is_rebuilt_along_its_chain_after_the_file_is_reopened(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path / "r.sqlite3", max_responses=10)
    store.put(response("r1", None, "one"), [user("a")])
    store.put(response("r2", "r1", "two"), [user("b")])
    store.put(response("other", None, "x"), [user("z")])
    store.close()
    reopened = ResponseStore(tmp_path / "r.sqlite3", max_responses=10)
    items = reopened.conversation("r2")
    assert [i.get("content") if i["role"] == "user" else i["content"][0]["text"] for i in items] == \
        ["a", "one", "b", "two"]
    assert reopened.get("r2") == response("r2", "r1", "two")
    assert reopened.delete("r2") and not reopened.delete("r2") and reopened.get("r2") is None
    assert ResponseStore(tmp_path / "r.sqlite3", max_responses=10).get("r2") is None  # each change is committed


def test_the_store_serves_the_threads_the_server_calls_it_from(tmp_path: Path) -> None:
    """Opened on the main thread, used from asyncio.to_thread's workers (sqlite3 refuses that by default)."""
    store = ResponseStore(tmp_path / "r.sqlite3", max_responses=10)
    with ThreadPoolExecutor(1) as worker:
        assert worker.submit(store.put, response("r1", None, "one"), [user("a")]).result() is True
        assert worker.submit(store.get, "r1").result() == response("r1", None, "one")


def test_the_oldest_responses_go_beyond_the_bound_and_a_chain_through_them_says_so(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path / "r.sqlite3", max_responses=2)
    store.put(response("r1", None, "one"), [user("a")])
    store.put(response("r2", "r1", "two"), [user("b")])
    store.put(response("r3", "r2", "three"), [user("c")])
    assert store.get("r1") is None and store.get("r2") is not None and store.get("r3") is not None
    with pytest.raises(RequestError, match="continues r1, which is no longer stored") as raised:
        store.conversation("r3")
    assert raised.value.param == "previous_response_id"
    with pytest.raises(RequestError, match=r"^Previous response with id 'r1' not found\.$"):
        store.conversation("r1")


def test_input_items_are_what_a_response_read_as_far_back_as_it_is_stored(tmp_path: Path) -> None:
    def texts(turns: list[tuple[str, list[dict]]]) -> list[tuple[str, str]]:
        return [(turn_id, i["content"] if i["role"] == "user" else i["content"][0]["text"])
                for turn_id, items in turns for i in items]

    store = ResponseStore(tmp_path / "r.sqlite3", max_responses=3)
    store.put(response("r1", None, "one"), [user("a")])
    store.put(response("r2", "r1", "two"), [user("b"), user("c")])
    assert texts(store.input_items("r2")) == [("r1", "a"), ("r1", "one"), ("r2", "b"), ("r2", "c")]
    store.put(response("r3", "r2", "three"), [user("d")])
    assert texts(store.input_items("r3")) == [("r1", "a"), ("r1", "one"), ("r2", "b"), ("r2", "c"), ("r2", "two"),
                                              ("r3", "d")]
    store.put(response("r4", "r3", "four"), [user("e")])  # r1 goes
    assert texts(store.input_items("r4")) == [("r2", "b"), ("r2", "c"), ("r2", "two"), ("r3", "d"), ("r3", "three"),
                                              ("r4", "e")]
    assert store.input_items("r1") is None


def test_listed_items_have_ids_that_stay_the_same_and_openai_s_part_types() -> None:
    call = {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "f", "arguments": "{}"}
    given = [user("hi"), {"role": "assistant", "content": "yes"}, call,
             {"type": "function_call_output", "call_id": "c1", "output": "ok", "id": None, "status": None},
             {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}]}]
    listed = listed_items(given, "resp_1")
    assert [i["id"].split("_")[0] for i in listed] == ["msg", "msg", "fc", "fco", "msg"] and listed[2]["id"] == "fc_1"
    assert len({i["id"] for i in listed}) == 5 and all(i["status"] == "completed" for i in listed)
    assert len(listed[0]["id"]) == len("msg_") + 32 and len(listed[3]["id"]) == len("fco_") + 32
    assert listed_items([{**call, "status": "incomplete"}], "resp_1")[0]["status"] == "incomplete"
    assert listed[0]["content"] == [{"type": "input_text", "text": "hi"}]
    assert listed[4]["content"] == [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]
    assert listed[1]["content"] == [{"type": "output_text", "text": "yes", "annotations": [], "logprobs": []}]
    # listed again (a stored row), or a row stored before items were kept listed: the same ids
    assert listed_items(listed, "resp_1") == listed == listed_items(given, "resp_1")
    assert listed_items(given, "resp_2")[0]["id"] != listed[0]["id"]


def _directory(tmp_path: Path, _: pytest.MonkeyPatch) -> Path:
    (tmp_path / "dir.sqlite3").mkdir()
    return tmp_path / "dir.sqlite3"


def _garbage(tmp_path: Path, _: pytest.MonkeyPatch) -> Path:
    (tmp_path / "garbage.sqlite3").write_bytes(bytes(range(256)) * 16)
    return tmp_path / "garbage.sqlite3"


def _under_a_file(tmp_path: Path, _: pytest.MonkeyPatch) -> Path:
    (tmp_path / "file").write_text("not a folder")
    return tmp_path / "file" / "r.sqlite3"


def _in_a_read_only_folder(tmp_path: Path, _: pytest.MonkeyPatch) -> Path:
    (tmp_path / "ro").mkdir(mode=0o555)
    return tmp_path / "ro" / "r.sqlite3"


def _read_only_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A store file that can be read, not written (opened read-only: root writes a file of mode 0o444)."""
    path = tmp_path / "ro.sqlite3"
    ResponseStore(path, max_responses=10).close()
    connect = sqlite3.connect
    monkeypatch.setattr(sqlite3, "connect", lambda p, **kw: connect(f"file:{p}?mode=ro", uri=True, **kw))
    return path


@pytest.mark.parametrize(("where", "said"), [
    (_directory, "a directory, not a file"),
    (_garbage, "cannot open it as an SQLite file: file is not a database"),
    (_under_a_file, "cannot make its folder: [Errno 17] File exists"),
    (_read_only_file, "cannot open it as an SQLite file: attempt to write a readonly database"),
    pytest.param(_in_a_read_only_folder, "cannot open it as an SQLite file: unable to open database file",
                 marks=pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")),
])
def test_a_path_that_cannot_be_a_store_is_refused_naming_it_and_why(where, said: str, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Each was a raw sqlite3 traceback at start (a read-only file: a failed write at each response)."""
    path = where(tmp_path, monkeypatch)
    with pytest.raises(ConfigError) as refused:
        ResponseStore(path, max_responses=10)
    assert str(refused.value).startswith(f"--responses-store {path}: {said}")
    assert "\n" not in str(refused.value)


def test_open_store_opens_the_file_the_settings_name_and_none_when_off(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    assert open_store(ServerConfig(responses_store="off")) is None
    default = open_store(ServerConfig(responses_store_max=3))
    assert default is not None and default.path == tmp_path / "cache" / "responses.sqlite3"
    assert default.max_responses == 3 and default.path.is_file()
    named = open_store(ServerConfig(responses_store=str(tmp_path / "a" / "b" / "c.sqlite3")))  # folders made
    assert named is not None and named.path == tmp_path / "a" / "b" / "c.sqlite3" and named.path.is_file()
    with pytest.raises(ConfigError, match="a directory"):
        open_store(ServerConfig(responses_store=str(tmp_path)))


def test_tokenmill_serve_refuses_a_store_that_cannot_be_one_before_the_model_loads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """One line on stderr, exit code 2, no traceback, as every other bad setting (the model named does not exist:
    had it been loaded first, that would have been the error)."""
    garbage = _garbage(tmp_path, monkeypatch)
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "/no/such/model.gguf", "--port", "0", "--responses-store", str(garbage)])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == \
        f"tokenmill: --responses-store {garbage}: cannot open it as an SQLite file: file is not a database\n"


def _fill(db: sqlite3.Connection) -> None:
    """The disk full: not one page more (a response larger than a page needs more)."""
    db.execute(f"PRAGMA max_page_count = {db.execute('PRAGMA page_count').fetchone()[0]}")


def _read_only(db: sqlite3.Connection) -> None:
    db.execute("PRAGMA query_only = ON")


@pytest.mark.parametrize(("failure", "why"), [(_fill, "database or disk is full"),
                                             (_read_only, "attempt to write a readonly database")])
def test_a_response_the_store_cannot_write_is_not_kept_and_put_says_so(failure, why: str, tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """A full disk or a read-only file: put is False (the route then answers store: false) and logs why; nothing of
    the response is kept, and the store goes on once it can write again."""
    store = ResponseStore(tmp_path / "r.sqlite3", max_responses=1)
    assert store.put(response("r1", None, "one"), [user("a")]) is True
    failure(store._db)
    big = response("r2", "r1", "x" * 20_000)
    assert store.put(big, [user("b")]) is False
    assert store.get("r2") is None and store.get("r1") == response("r1", None, "one")  # r1 was not bounded out
    assert caplog.messages == [f"response r2 not stored in {tmp_path / 'r.sqlite3'} ({why}): answered with store "
                               "false"]
    store._db.execute("PRAGMA query_only = OFF")
    store._db.execute("PRAGMA max_page_count = 1000000")
    assert store.put(big, [user("b")]) is True
    assert store.get("r2") == big and store.get("r1") is None
