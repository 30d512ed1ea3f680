"""The Responses store: rows survive reopening the file, the oldest go beyond the bound, and a conversation is
rebuilt along its chain of previous responses, as are the input items a response read."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill.api.response_store import ResponseStore
from tokenmill.api.responses_api import listed_items
from tokenmill.errors import RequestError


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


def test_the_oldest_responses_go_beyond_the_bound_and_a_chain_through_them_says_so(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path / "r.sqlite3", max_responses=2)
    store.put(response("r1", None, "one"), [user("a")])
    store.put(response("r2", "r1", "two"), [user("b")])
    store.put(response("r3", "r2", "three"), [user("c")])
    assert store.get("r1") is None and store.get("r2") is not None and store.get("r3") is not None
    with pytest.raises(RequestError, match="continues r1, which is no longer stored") as raised:
        store.conversation("r3")
    assert raised.value.param == "previous_response_id"
    with pytest.raises(RequestError, match="'r1' not found"):
        store.conversation("r1")


def test_input_items_are_what_a_response_read_as_far_back_as_it_is_stored(tmp_path: Path) -> None:
    def texts(turns: list[tuple[str, list[dict]]]) -> list[tuple[str, str]]:
        return [(turn_id, i["content"] if i["role"] == "user" else i["content"][0]["text"])
                for turn_id, items in turns for i in items]

    store = ResponseStore(tmp_path / "r.sqlite3", max_responses=2)
    store.put(response("r1", None, "one"), [user("a")])
    store.put(response("r2", "r1", "two"), [user("b"), user("c")])
    assert texts(store.input_items("r2")) == [("r1", "a"), ("r1", "one"), ("r2", "b"), ("r2", "c")]
    store.put(response("r3", "r2", "three"), [user("d")])  # r1 goes
    assert texts(store.input_items("r3")) == [("r2", "b"), ("r2", "c"), ("r2", "two"), ("r3", "d")]
    assert store.input_items("r1") is None


def test_listed_items_have_ids_that_stay_the_same_and_openai_s_part_types() -> None:
    call = {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "f", "arguments": "{}"}
    given = [user("hi"), {"role": "assistant", "content": "yes"}, call,
             {"type": "function_call_output", "call_id": "c1", "output": "ok", "id": None, "status": None},
             {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}]}]
    listed = listed_items(given, "resp_1")
    assert [i["id"].split("_")[0] for i in listed] == ["msg", "msg", "fc", "fco", "msg"] and listed[2]["id"] == "fc_1"
    assert len({i["id"] for i in listed}) == 5 and all(i["status"] == "completed" for i in listed)
    assert listed[0]["content"] == [{"type": "input_text", "text": "hi"}]
    assert listed[4]["content"] == [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]
    assert listed[1]["content"] == [{"type": "output_text", "text": "yes", "annotations": [], "logprobs": []}]
    # listed again (a stored row), or a row stored before items were kept listed: the same ids
    assert listed_items(listed, "resp_1") == listed == listed_items(given, "resp_1")
    assert listed_items(given, "resp_2")[0]["id"] != listed[0]["id"]
