"""Tenants end to end through the openai SDK, on the tiny model: each limit accepted at its value and refused one
past it (RateLimitError with OpenAI's headers, PermissionDeniedError), a stream cut by tokens per minute, stored
responses and admin routes kept apart, the keys file reloaded without a restart, and usage that agrees with the
answers' usage fields, after a restart too. No key appears in the logs, the metrics or the dashboard's data."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from helpers import ServerThread

from tokenmill.config import ServerConfig
from tokenmill.loader import LoadedModel
from tokenmill.tenants.keys import add_key, hash_key

MODEL = "tiny"
HI = [{"role": "user", "content": "hi"}]
KEYS = {"rpm": "key-rpm", "tpm": "key-tpm", "cut": "key-cut", "cap": "key-cap", "other": "key-other",
        "busy": "key-busy", "alice": "key-alice", "bob": "key-bob", "root": "key-root"}


def keys_file(path: Path, prompt_tokens: int) -> Path:
    """Limits sized by the prompt of HI (prompt_tokens): tpm holds two requests of 4 tokens exactly, cut one of 4
    tokens and 3 of the next."""
    limits = {"rpm": "requests_per_minute = 3", "tpm": f"tokens_per_minute = {2 * (prompt_tokens + 4)}",
              "cut": f"tokens_per_minute = {2 * prompt_tokens + 4 + 3}", "cap": "max_tokens = 6",
              "other": 'models = ["another-model"]', "busy": "max_concurrent_requests = 1",
              "alice": "", "bob": "", "root": 'role = "admin"'}
    text = "".join(f"[tenants.{name}]\n{setting}\n\n" for name, setting in limits.items())
    text += "".join(f'[[keys]]\ntenant = "{name}"\nsha256 = "{hash_key(key)}"\n\n' for name, key in KEYS.items())
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def prompt_tokens(tiny4k: LoadedModel) -> int:
    with ServerThread(tiny4k, MODEL) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
        return client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1).usage.prompt_tokens


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tenants") / "store.sqlite3"


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory, prompt_tokens: int) -> Path:
    return keys_file(tmp_path_factory.mktemp("keys") / "keys.toml", prompt_tokens)


@pytest.fixture(scope="module")
def server(tiny4k: LoadedModel, keys: Path, store: Path):
    with ServerThread(tiny4k, MODEL, ServerConfig(api_keys=str(keys), responses_store=str(store)),
                      max_num_seqs=8) as srv:
        yield srv


def sdk(srv: ServerThread, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url, api_key=KEYS[tenant], max_retries=0, timeout=60)


def ask(client: openai.OpenAI, max_tokens: int | None = 4, **fields):
    return client.chat.completions.with_raw_response.create(model=MODEL, messages=HI, max_tokens=max_tokens,
                                                            extra_body={"ignore_eos": True}, **fields)


def test_requests_per_minute_hold_at_their_value_and_refuse_one_past_it(server: ServerThread) -> None:
    client = sdk(server, "rpm")
    remaining = [ask(client, 1).headers["x-ratelimit-remaining-requests"] for _ in range(3)]
    assert remaining == ["2", "1", "0"]
    with pytest.raises(openai.RateLimitError) as raised:
        ask(client, 1)
    headers = raised.value.response.headers
    assert raised.value.code == "rate_limit_exceeded" and headers["x-ratelimit-limit-requests"] == "3"
    assert headers["x-ratelimit-remaining-requests"] == "0" and 1 <= int(headers["retry-after"]) <= 60


def test_tokens_per_minute_hold_at_their_value_and_refuse_one_past_it(server: ServerThread,
                                                                       prompt_tokens: int) -> None:
    client = sdk(server, "tpm")
    limit = 2 * (prompt_tokens + 4)
    first = ask(client)
    assert first.headers["x-ratelimit-limit-tokens"] == str(limit)
    assert first.parse().usage.completion_tokens == 4
    second = ask(client).parse()
    assert second.usage.total_tokens == prompt_tokens + 4 and second.choices[0].finish_reason == "length"
    with pytest.raises(openai.RateLimitError) as raised:
        ask(client)
    assert raised.value.response.headers["x-ratelimit-remaining-tokens"] == "0"
    assert raised.value.body["type"] == "tokens" and f"Limit {limit}, Used {limit}" in raised.value.message


def test_a_stream_cut_by_tokens_per_minute_keeps_what_it_was_given_and_ends_with_an_error(
        server: ServerThread) -> None:
    client = sdk(server, "cut")
    assert ask(client).parse().usage.completion_tokens == 4
    stream = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True},
                                            extra_body={"ignore_eos": True})
    chunks = []
    with pytest.raises(openai.APIError, match="tokens per min"):
        for chunk in stream:
            chunks.append(chunk)
    finished = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finished and finished[0].choices[0].finish_reason == "length"
    assert max(c.usage.completion_tokens for c in chunks if c.usage) == 3  # the 3 that fit, none past them


def test_max_tokens_is_capped_at_the_key_s_value(server: ServerThread) -> None:
    client = sdk(server, "cap")
    assert ask(client, 6).parse().usage.completion_tokens == 6
    with pytest.raises(openai.PermissionDeniedError) as raised:
        ask(client, 7)
    assert raised.value.code == "max_tokens_not_allowed"
    assert ask(client, None).parse().usage.completion_tokens == 6  # unasked: the cap, not the rest of the context


def test_a_model_the_key_may_not_use_is_403_and_not_listed(server: ServerThread) -> None:
    client = sdk(server, "other")
    with pytest.raises(openai.PermissionDeniedError) as raised:
        ask(client)
    assert raised.value.code == "model_not_allowed"
    assert client.models.list().data == []
    with pytest.raises(openai.PermissionDeniedError):
        client.models.retrieve(MODEL)
    assert [m.id for m in sdk(server, "alice").models.list().data] == [MODEL]


def test_concurrent_requests_hold_at_their_value(server: ServerThread) -> None:
    client = sdk(server, "busy")
    stream = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=200, stream=True,
                                            extra_body={"ignore_eos": True})
    with pytest.raises(openai.RateLimitError, match="concurrent"):
        ask(client, 1)
    stream.close()
    deadline = time.monotonic() + 5
    while True:  # the first request ends once the server notices its client left
        try:
            assert ask(client, 1).parse().usage.completion_tokens == 1
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_a_tenant_sees_only_its_own_stored_responses(server: ServerThread) -> None:
    alice, bob = sdk(server, "alice"), sdk(server, "bob")
    kept = alice.responses.create(model=MODEL, input="hello", max_output_tokens=3)
    assert alice.responses.retrieve(kept.id).id == kept.id
    for attempt in (lambda: bob.responses.retrieve(kept.id), lambda: bob.responses.input_items.list(kept.id),
                    lambda: bob.responses.delete(kept.id),
                    lambda: bob.responses.create(model=MODEL, input="more", previous_response_id=kept.id,
                                                 max_output_tokens=2)):
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert alice.responses.input_items.list(kept.id).data  # still there: bob's delete did nothing
    alice.responses.create(model=MODEL, input="more", previous_response_id=kept.id, max_output_tokens=2)


@pytest.mark.parametrize("path", ["/metrics", "/stats"])
def test_a_user_key_may_not_read_the_server_s_numbers(server: ServerThread, path: str) -> None:
    response = httpx.get(server.root_url + path, headers={"Authorization": f"Bearer {KEYS['alice']}"})
    assert response.status_code == 403 and response.json()["error"]["code"] == "admin_only"
    assert httpx.get(server.root_url + path, headers={"Authorization": f"Bearer {KEYS['root']}"}).status_code == 200


def test_a_key_added_to_the_file_works_within_two_seconds_and_a_broken_file_keeps_the_old_ones(
        server: ServerThread, keys: Path) -> None:
    before = keys.read_text()
    new = add_key(keys, "carol")
    deadline = time.monotonic() + 2
    while True:
        try:
            sdk_new = openai.OpenAI(base_url=server.base_url, api_key=new, max_retries=0)
            assert sdk_new.models.list().data
            break
        except openai.AuthenticationError:
            assert time.monotonic() < deadline, "the new key was not taken within 2 s"
            time.sleep(0.05)
    keys.write_text(before + "\n[tenants.broken]\nweight = 0\n")
    time.sleep(1.2)  # two looks at the file
    assert sdk(server, "alice").models.list().data and sdk_new.models.list().data
    keys.write_text(before)  # carol's key goes with the restored file
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        try:
            sdk_new.models.list()
        except openai.AuthenticationError:
            break
        time.sleep(0.05)
    else:
        pytest.fail("a key removed from the file still works after 2 s")


def usage_of(srv: ServerThread, tenant: str, key: str = "root") -> dict[str, int]:
    body = httpx.get(srv.root_url + "/v1/usage", params={"tenant": tenant, "bucket_width": "1d",
                                                         "start_time": int(time.time()) - 86400},
                     headers={"Authorization": f"Bearer {KEYS[key]}"}).json()
    totals = {"input_tokens": 0, "output_tokens": 0, "input_cached_tokens": 0, "num_model_requests": 0}
    for bucket in body["data"]:
        for row in bucket["results"]:
            assert row["tenant"] == tenant
            for name in totals:
                totals[name] += row[name]
    return totals


def metrics_of(srv: ServerThread, tenant: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(srv.root_url + "/metrics", headers={"Authorization": f"Bearer {KEYS['root']}"}).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.labels.get("tenant") == tenant}


def test_usage_agrees_with_the_answers_and_survives_a_restart(tiny4k: LoadedModel, keys: Path, store: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    config = ServerConfig(api_keys=str(keys), responses_store=str(store))
    with ServerThread(tiny4k, MODEL, config, max_num_seqs=8) as srv:
        bob = sdk(srv, "bob")
        answered = usage_of(srv, "bob")  # what earlier tests' answers counted
        answers = [bob.chat.completions.create(model=MODEL, messages=HI, max_tokens=3, n=2).usage,
                   bob.completions.create(model=MODEL, prompt=["a b", "c"], max_tokens=2).usage,
                   bob.embeddings.create(model=MODEL, input=["x y z"]).usage]
        chunks = list(bob.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, stream=True,
                                                  stream_options={"include_usage": True}))
        answers.append(chunks[-1].usage)
        response = bob.responses.create(model=MODEL, input="hi", max_output_tokens=2).usage
        prompt = sum(u.prompt_tokens for u in answers) + response.input_tokens
        completion = sum(getattr(u, "completion_tokens", 0) for u in answers) + response.output_tokens
        expected = {"input_tokens": answered["input_tokens"] + prompt,
                    "output_tokens": answered["output_tokens"] + completion,
                    "num_model_requests": answered["num_model_requests"] + 5}
        got = usage_of(srv, "bob")
        assert {k: got[k] for k in expected} == expected
        assert usage_of(srv, "bob", key="bob") == got  # a user reads its own
        assert httpx.get(srv.root_url + "/v1/usage", params={"tenant": "alice"},
                         headers={"Authorization": f"Bearer {KEYS['bob']}"}).status_code == 403
        counters = metrics_of(srv, "bob")
        assert counters["tokenmill:tenant_prompt_tokens_total"] == got["input_tokens"]
        assert counters["tokenmill:tenant_completion_tokens_total"] == got["output_tokens"]
        assert counters["tokenmill:tenant_requests_total"] == got["num_model_requests"]
        stats = httpx.get(srv.root_url + "/stats", headers={"Authorization": f"Bearer {KEYS['root']}"})
        shares = {entry["tenant"]: entry["share"] for entry in stats.json()["tenants"]}
        assert shares["bob"] > 0 and abs(sum(shares.values()) - 1) < 1e-3
        seen = httpx.get(srv.root_url + "/metrics", headers={"Authorization": f"Bearer {KEYS['root']}"}).text + \
            stats.text
    with ServerThread(tiny4k, MODEL, config, max_num_seqs=8) as again:
        assert usage_of(again, "bob") == got
        assert metrics_of(again, "bob")["tokenmill:tenant_completion_tokens_total"] == got["output_tokens"]
    for key in KEYS.values():
        assert key not in caplog.text and key not in seen


@pytest.mark.parametrize(("params", "param"), [
    ({"bucket_width": "1w"}, "bucket_width"), ({"start_time": 100, "end_time": 50}, "start_time"),
    ({"start_time": -5}, "start_time"), ({"start_time": 0, "bucket_width": "1m"}, "bucket_width"),
    ({"start_time": "yesterday"}, "start_time"), ({"end_time": 1.5}, "end_time"),
])
def test_a_bad_usage_query_is_a_400_naming_the_field(server: ServerThread, params: dict, param: str) -> None:
    response = httpx.get(server.root_url + "/v1/usage", params=params,
                         headers={"Authorization": f"Bearer {KEYS['root']}"})
    assert response.status_code == 400 and response.json()["error"]["param"] == param
    assert httpx.get(server.root_url + "/v1/usage", headers={"Authorization": f"Bearer {KEYS['root']}"}
                     ).status_code == 200


def test_the_prefix_cache_is_shared_within_a_tenant_only(server: ServerThread) -> None:
    """A tenant cannot tell from its cached tokens (or its time to first token) that another sent the same prompt."""
    long = [{"role": "user", "content": "a shared system prompt of some length " * 12}]

    def cached(tenant: str) -> int:
        usage = sdk(server, tenant).chat.completions.create(model=MODEL, messages=long, max_tokens=1).usage
        return usage.prompt_tokens_details.cached_tokens

    assert cached("alice") == 0
    assert cached("bob") == 0  # alice's KV for the same prompt is not bob's to reuse
    assert cached("alice") > 0 and cached("bob") > 0  # each reuses its own


def test_shared_steps_take_turns_and_every_answer_is_whole(tiny4k: LoadedModel, keys: Path) -> None:
    """--shared-step-ms so short that one decode fits: while alice and bob share the engine, each step decodes one of
    their sequences, in turns, and every stream still gets all its tokens."""
    with ServerThread(tiny4k, MODEL, ServerConfig(api_keys=str(keys)), max_num_seqs=8,
                      shared_step_ms=1e-6) as srv:
        scheduler = srv.engine.scheduler
        plans: list[tuple[int, int]] = []  # (decodes planned, sequences decoding) of each step
        schedule = scheduler.schedule

        def recorded():
            plan = schedule()
            plans.append((sum(item.seq.decoding for item in plan),
                          sum(seq.decoding for seq in scheduler.running)))
            return plan

        scheduler.schedule = recorded

        def stream(tenant: str, tokens: int) -> int:
            chunks = sdk(srv, tenant).chat.completions.create(
                model=MODEL, messages=HI, max_tokens=tokens, stream=True, extra_body={"ignore_eos": True},
                stream_options={"include_usage": True})
            return [chunk.usage.completion_tokens for chunk in chunks if chunk.usage][-1]

        with ThreadPoolExecutor(4) as pool:
            answers = [pool.submit(stream, "alice", 24) for _ in range(3)] + [pool.submit(stream, "bob", 24)]
            assert [answer.result() for answer in answers] == [24] * 4
    assert scheduler.decode_seconds is not None
    assert any(planned == 1 and decoding > 1 for planned, decoding in plans)  # the others sat that step out
