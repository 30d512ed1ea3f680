"""Bad input, overload, disconnects and auth against a live server on a tiny model: every mistake is a 4xx OpenAI
error object, and the server keeps serving afterwards with nothing leaked."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from helpers import ServerThread, assert_no_live_blocks, generate, start_engine, submit

from tokenmill.api.app import create_app
from tokenmill.api.engine_client import EngineClient
from tokenmill.api.errors import http_status
from tokenmill.config import ServerConfig
from tokenmill.errors import ConfigError, RequestError, ServerBusyError
from tokenmill.loader import LoadedModel
from tokenmill.sampling import SamplingParams

MODEL = "tiny"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
RESPONSES = "/v1/responses"
HI = [{"role": "user", "content": "hi"}]
LIMITS = ServerConfig(max_request_bytes=64 * 1024, max_json_depth=32, max_seqs_per_request=4, max_messages=8,
                      max_stop=4, max_logit_bias=16, chat_template_timeout=0.5, chat_template_max_chars=2000,
                      allow_request_chat_template=True)
CONTEXT = 4096


@pytest.fixture(scope="module")
def server(tiny4k: LoadedModel):
    with ServerThread(tiny4k, MODEL, LIMITS, max_num_seqs=8) as srv:
        yield srv


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": HI, "max_tokens": 2, **fields}


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **fields}


# (name, method, path, JSON body or raw bytes, extra headers, expected status, expected param or None)
CASES = [
    ("malformed json", "POST", CHAT, b"{not json", {}, 400, None),
    ("truncated json", "POST", CHAT, b'{"model": "tiny", "messages": [', {}, 400, None),
    ("body is an array", "POST", CHAT, [], {}, 400, None),
    ("body is a string", "POST", CHAT, "hello", {}, 400, None),
    ("empty body", "POST", CHAT, b"", {}, 400, None),
    ("text/plain body", "POST", CHAT, b"hello", {"content-type": "text/plain"}, 400, None),
    ("NaN literal", "POST", CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '
                                  b'"temperature": NaN}', {}, 400, "temperature"),
    # JSON escapes that parse but are no Unicode: refused, naming the field, before a tokenizer sees them
    ("lone surrogate in content", "POST", CHAT, b'{"model": "tiny", "messages": [{"role": "user", '
                                                b'"content": "a\\ud800b"}]}', {}, 400, "messages.0.content"),
    ("lone surrogate in a content part", "POST", CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": '
                                                       b'[{"type": "text", "text": "\\udfff"}]}]}', {}, 400,
     "messages.0.content.0.text"),
    ("lone surrogate in a prompt", "POST", COMPLETIONS, b'{"model": "tiny", "prompt": ["ok", "\\udc00"]}', {}, 400,
     "prompt.1"),
    ("lone surrogate in a stop string", "POST", COMPLETIONS, b'{"model": "tiny", "prompt": "hi", '
                                                             b'"stop": "\\ud83d"}', {}, 400, "stop"),
    ("lone surrogate in an embedding input", "POST", EMBEDDINGS, b'{"model": "tiny", "input": "hi \\ud800"}', {},
     400, "input"),
    ("lone surrogate in a response's metadata", "POST", RESPONSES, b'{"model": "tiny", "input": "hi", '
     b'"max_output_tokens": 2, "metadata": {"k": "\\ud800"}}', {}, 400, "metadata.k"),
    ("lone surrogate in a response's user", "POST", RESPONSES, b'{"model": "tiny", "input": "hi", '
     b'"max_output_tokens": 2, "user": "\\udfff"}', {}, 400, "user"),
    ("missing model", "POST", CHAT, {"messages": HI}, {}, 400, "model"),
    ("missing messages", "POST", CHAT, {"model": MODEL}, {}, 400, "messages"),
    ("messages not a list", "POST", CHAT, chat(messages="hi"), {}, 400, "messages"),
    ("empty messages", "POST", CHAT, chat(messages=[]), {}, 400, "messages"),
    ("message without role", "POST", CHAT, chat(messages=[{"content": "hi"}]), {}, 400, "messages.0.role"),
    ("unknown role", "POST", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), {}, 400,
     "messages.0.role"),
    ("content of wrong type", "POST", CHAT, chat(messages=[{"role": "user", "content": 5}]), {}, 400, None),
    ("image content part", "POST", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), {}, 400, "messages"),
    ("temperature a string", "POST", CHAT, chat(temperature="hot"), {}, 400, "temperature"),
    ("temperature negative", "POST", CHAT, chat(temperature=-1), {}, 400, "temperature"),
    ("temperature too high", "POST", CHAT, chat(temperature=2.5), {}, 400, "temperature"),
    ("top_p zero", "POST", CHAT, chat(top_p=0), {}, 400, "top_p"),
    ("top_p over one", "POST", CHAT, chat(top_p=1.5), {}, 400, "top_p"),
    ("top_k too small", "POST", CHAT, chat(top_k=-5), {}, 400, "top_k"),
    ("min_p over one", "POST", CHAT, chat(min_p=2), {}, 400, "min_p"),
    ("tool parameters not an object", "POST", CHAT,
     chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]), {}, 400,
     "tools.0.function.parameters"),
    ("n zero", "POST", CHAT, chat(n=0), {}, 400, "n"),
    ("n huge", "POST", CHAT, chat(n=10**6), {}, 400, "n"),
    ("n fractional", "POST", CHAT, chat(n=1.5), {}, 400, "n"),
    ("max_tokens zero", "POST", CHAT, chat(max_tokens=0), {}, 400, "max_tokens"),
    ("max_tokens negative", "POST", CHAT, chat(max_tokens=-5), {}, 400, "max_tokens"),
    ("max_tokens over the context", "POST", CHAT, chat(max_tokens=10**30), {}, 400, "max_tokens"),
    ("max_completion_tokens zero", "POST", CHAT, chat(max_completion_tokens=0), {}, 400, "max_completion_tokens"),
    ("max_completion_tokens over the context", "POST", CHAT, chat(max_completion_tokens=10**30), {}, 400,
     "max_completion_tokens"),
    ("messages null", "POST", CHAT, chat(messages=None), {}, 400, "messages"),
    # pydantic's union branches ('str', 'list[...]', a class name) are no field: the param names the request's
    ("responses input a number", "POST", RESPONSES, {"model": MODEL, "input": 5}, {}, 400, "input"),
    ("responses input items not objects", "POST", RESPONSES, {"model": MODEL, "input": ["hi"]}, {}, 400, "input.0"),
    ("embedding input nested strings", "POST", EMBEDDINGS, {"model": MODEL, "input": [["a"]]}, {}, 400, "input.0.0"),
    ("embedding input a boolean id", "POST", EMBEDDINGS, {"model": MODEL, "input": [True]}, {}, 400, "input.0"),
    ("prompt ids of floats", "POST", COMPLETIONS, completion(prompt=[[1.0, 2]]), {}, 400, "prompt.0.0"),
    ("tool_choice of an unknown kind", "POST", CHAT, chat(tool_choice={"type": "allowed_tools"}), {}, 400,
     "tool_choice.type"),
    ("min_tokens over max_tokens", "POST", CHAT, chat(min_tokens=5), {}, 400, "min_tokens"),
    ("top_logprobs over 20", "POST", CHAT, chat(logprobs=True, top_logprobs=21), {}, 400, "top_logprobs"),
    ("top_logprobs without logprobs", "POST", CHAT, chat(top_logprobs=2), {}, 400, "top_logprobs"),
    ("presence_penalty too high", "POST", CHAT, chat(presence_penalty=3), {}, 400, "presence_penalty"),
    ("frequency_penalty too low", "POST", CHAT, chat(frequency_penalty=-3), {}, 400, "frequency_penalty"),
    ("repetition_penalty zero", "POST", CHAT, chat(repetition_penalty=0), {}, 400, "repetition_penalty"),
    ("logit_bias key not a token id", "POST", CHAT, chat(logit_bias={"abc": 1}), {}, 400, "logit_bias"),
    ("logit_bias id outside the vocabulary", "POST", CHAT, chat(logit_bias={"99999999": 1}), {}, 400,
     "logit_bias"),
    ("logit_bias value out of range", "POST", CHAT, chat(logit_bias={"5": 1000}), {}, 400, "logit_bias"),
    ("empty stop string", "POST", CHAT, chat(stop=[""]), {}, 400, "stop"),
    ("stop_token_ids outside the vocabulary", "POST", CHAT, chat(stop_token_ids=[10**6]), {}, 400,
     "stop_token_ids"),
    ("seed out of range", "POST", CHAT, chat(seed=2**70), {}, 400, "seed"),
    ("stream not a boolean", "POST", CHAT, chat(stream="maybe"), {}, 400, "stream"),
    ("stream_options without stream", "POST", CHAT, chat(stream_options={"include_usage": True}), {}, 400,
     "stream_options"),
    ("prompt over the context", "POST", CHAT, chat(messages=[{"role": "user", "content": "word " * 1000}]), {},
     400, "messages"),
    ("prompt ids outside the vocabulary", "POST", COMPLETIONS, completion(prompt=[999999]), {}, 400, "prompt"),
    ("negative prompt ids", "POST", COMPLETIONS, completion(prompt=[-1, 5]), {}, 400, "prompt"),
    ("empty prompt list", "POST", COMPLETIONS, completion(prompt=[]), {}, 400, "prompt"),
    ("prompt ids of mixed types", "POST", COMPLETIONS, completion(prompt=[[1, "a"]]), {}, 400, None),
    ("completion logprobs over 20", "POST", COMPLETIONS, completion(logprobs=50), {}, 400, "logprobs"),
    ("best_of unlike n", "POST", COMPLETIONS, completion(best_of=3), {}, 400, "best_of"),
    ("echo with stream", "POST", COMPLETIONS, completion(echo=True, stream=True), {}, 400, "echo"),
    ("unknown model", "POST", CHAT, chat(model="gpt-9"), {}, 404, "model"),
    ("wrong method", "GET", CHAT, None, {}, 405, None),
    ("unknown route", "POST", "/v1/edits", chat(), {}, 404, None),
    ("oversized body", "POST", CHAT, chat(messages=[{"role": "user", "content": "x" * 70_000}]), {}, 413, None),
    ("nesting the JSON parser refuses", "POST", CHAT,
     b'{"model": "tiny", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", {}, 400, None),
    ("sandbox escape in a request template", "POST", CHAT,
     chat(chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}"), {}, 400, "messages"),
    ("endless request template", "POST", CHAT,
     chat(chat_template="{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"), {},
     400, "messages"),
    ("request template that writes too much", "POST", CHAT,
     chat(chat_template="{% for i in range(100000) %}{{ 'xxxxxxxxxx' }}{% endfor %}"), {}, 400, "messages"),
    ("request template that multiplies a string", "POST", CHAT, chat(chat_template="{{ 'a' * 10**9 }}"), {}, 400,
     "messages"),
    ("request template that raises a power", "POST", CHAT, chat(chat_template="{{ 7 ** 1000000000 }}"), {}, 400,
     "messages"),
    ("request template that does not compile", "POST", CHAT, chat(chat_template="{% for %}"), {}, 400,
     "chat_template"),
]


def writes(chars: int) -> str:
    """A request chat template that renders exactly chars characters."""
    return f"{{% for i in range({chars}) %}}x{{% endfor %}}"


# (limit, a valid body at the limit, one just past it, route, the refusal's param)
AT_AND_PAST = [
    ("n", chat(n=4), chat(n=5), CHAT, "n"),
    ("prompts times n", completion(prompt=["a", "b"], n=2), completion(prompt=["a", "b", "c"], n=2), COMPLETIONS,
     "n"),
    ("messages", chat(messages=HI * 8), chat(messages=HI * 9), CHAT, "messages"),
    ("stop strings", chat(stop=list("abcd")), chat(stop=list("abcde")), CHAT, "stop"),
    ("logit_bias entries", chat(logit_bias={str(i): 1 for i in range(16)}),
     chat(logit_bias={str(i): 1 for i in range(17)}), CHAT, "logit_bias"),
    ("chat template output", chat(chat_template=writes(2000)), chat(chat_template=writes(2001)), CHAT, "messages"),
    ("top_logprobs", chat(logprobs=True, top_logprobs=20), chat(logprobs=True, top_logprobs=21), CHAT,
     "top_logprobs"),
    ("completion logprobs", completion(logprobs=20), completion(logprobs=21), COMPLETIONS, "logprobs"),
    ("context", completion(prompt=[5] * (CONTEXT - 1), max_tokens=1),
     completion(prompt=[5] * (CONTEXT - 1), max_tokens=2), COMPLETIONS, "max_tokens"),
]


@pytest.mark.parametrize("case", AT_AND_PAST, ids=[c[0] for c in AT_AND_PAST])
def test_a_limit_is_accepted_at_its_value_and_refused_one_past_it(server: ServerThread, case: tuple) -> None:
    _, at, past, path, param = case
    response = httpx.post(server.root_url + path, json=at, timeout=30)
    assert response.status_code == 200, response.text
    assert_error_object(httpx.post(server.root_url + path, json=past, timeout=30), 400, param)
    assert_no_live_blocks(server.engine)


def test_token_ids_are_accepted_up_to_the_last_of_the_vocabulary_and_refused_past_it(server: ServerThread) -> None:
    last = server.engine.tokenizer.vocab_size - 1
    for param, body in (("prompt", lambda t: completion(prompt=[t])),
                        ("logit_bias", lambda t: completion(logit_bias={str(t): 1})),
                        ("stop_token_ids", lambda t: completion(stop_token_ids=[t]))):
        response = httpx.post(server.root_url + COMPLETIONS, json=body(last), timeout=30)
        assert response.status_code == 200, response.text
        assert_error_object(httpx.post(server.root_url + COMPLETIONS, json=body(last + 1), timeout=30), 400, param)
    assert_no_live_blocks(server.engine)


def test_body_size_and_nesting_are_accepted_at_their_limit_and_refused_one_past_it(server: ServerThread) -> None:
    def padded(size: int) -> bytes:
        body = json.dumps(chat()).encode()
        return body + b" " * (size - len(body))  # whitespace after the value: still valid JSON

    def nested(depth: int) -> bytes:  # lists in a message's own field (messages pass extra fields to templates)
        message = {**HI[0], "nest": json.loads("[" * (depth - 3) + "]" * (depth - 3))}
        return json.dumps(chat(messages=[message])).encode()

    for body, status in ((padded(LIMITS.max_request_bytes), 200), (padded(LIMITS.max_request_bytes + 1), 413),
                         (nested(LIMITS.max_json_depth), 200), (nested(LIMITS.max_json_depth + 1), 400)):
        response = send(server, "POST", CHAT, body, {})
        assert response.status_code == status, response.text
    assert "nests deeper than 32 levels" in response.json()["error"]["message"]


def test_kv_memory_below_one_context_caps_the_context_served(tiny4k: LoadedModel) -> None:
    kv_64_tokens = str(4 * 16 * 512)
    engine = start_engine(tiny4k, kv_cache_memory=kv_64_tokens)
    try:
        assert (tiny4k.max_model_len, engine.max_model_len) == (CONTEXT, 64)
        # max_tokens left out: the rest of the served context, which the KV memory holds
        [tokens] = generate(engine, [[5] * 10], [SamplingParams(max_tokens=None, ignore_eos=True)])
        assert len(tokens) == 54
    finally:
        engine.stop()
    with pytest.raises(ConfigError, match=f"--max-model-len {CONTEXT} needs KV memory for {CONTEXT} tokens; "
                                         "--kv-cache-memory holds 64"):
        start_engine(tiny4k, kv_cache_memory=kv_64_tokens, max_model_len=CONTEXT)


def test_an_embedding_may_fill_the_context_a_completion_may_not(tiny4k: LoadedModel) -> None:
    """An embedding generates nothing, so its input may be the whole served context (64 tokens here); a completion
    needs room for one token more."""
    with ServerThread(tiny4k, MODEL, kv_cache_memory=str(4 * 16 * 512)) as srv:
        assert srv.engine.max_model_len == 64
        whole = httpx.post(f"{srv.base_url}/embeddings", json={"model": MODEL, "input": [[5] * 64]}, timeout=60)
        assert whole.status_code == 200 and whole.json()["usage"]["prompt_tokens"] == 64, whole.text
        assert len(whole.json()["data"][0]["embedding"]) == srv.engine.hidden_size
        for path, body in (("embeddings", {"input": [[5] * 65]}), ("completions", {"prompt": [5] * 64})):
            error = httpx.post(f"{srv.base_url}/{path}", json={"model": MODEL, **body}, timeout=60).json()["error"]
            assert (error["code"], error["param"]) == ("context_length_exceeded", next(iter(body))), error
        assert_no_live_blocks(srv.engine)


@pytest.mark.parametrize("flag", ["max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len",
                                  "threads"])
def test_a_count_below_one_is_refused_at_start(tiny4k: LoadedModel, flag: str) -> None:
    """--max-num-batched-tokens 0 once started a server whose requests waited forever."""
    with pytest.raises(ConfigError, match=f"--{flag.replace('_', '-')} 0: at least 1"):
        start_engine(tiny4k, **{flag: 0})


def test_the_queue_and_the_kv_cache_hold_exactly_what_they_are_sized_for(tiny4k: LoadedModel) -> None:
    engine = start_engine(tiny4k, max_num_seqs=1, max_queued_requests=2, kv_cache_memory=str(4 * 16 * 512))
    client = EngineClient(engine)

    async def scenario() -> None:
        running = submit(engine, [5] * 10, SamplingParams(max_tokens=54, ignore_eos=True))  # 64: the whole cache
        # the served context is capped to what the KV memory holds (64 tokens of the model's 4096)
        with pytest.raises(RequestError, match="maximum context length is 64 tokens"):
            submit(engine, [5] * 10, SamplingParams(max_tokens=55))
        outputs = aiter(running)
        await anext(outputs)
        await anext(outputs)  # a step later: the engine counts it as running
        client._check_capacity(2)
        with pytest.raises(ServerBusyError) as busy:
            client._check_capacity(3)
        assert http_status(busy.value) == 429
        queued = [submit(engine, [5] * 10, SamplingParams(max_tokens=2)) for _ in range(2)]
        with pytest.raises(ServerBusyError):
            client._check_capacity(1)
        for stream in (running, *queued):
            stream.abort()
            async for _ in stream:  # to its last output, before this event loop closes
                pass

    try:
        asyncio.run(scenario())
    finally:
        engine.stop()


def send(srv: ServerThread, method: str, path: str, body, headers: dict) -> httpx.Response:
    if body is None:
        return httpx.request(method, srv.root_url + path, headers=headers, timeout=30)
    if isinstance(body, bytes):
        return httpx.request(method, srv.root_url + path, content=body,
                             headers={"content-type": "application/json", **headers}, timeout=30)
    return httpx.request(method, srv.root_url + path, json=body, headers=headers, timeout=30)


def assert_error_object(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert "Traceback" not in response.text
    if param is not None:
        assert error["param"] == param, error
    return error


def assert_serves(srv: ServerThread) -> None:
    response = httpx.post(srv.root_url + CHAT, json=chat(), timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_at_least_thirty_bad_inputs() -> None:
    assert len(CASES) >= 30 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_a_4xx_error_object_and_the_server_keeps_serving(server: ServerThread, case: tuple) -> None:
    _, method, path, body, headers, status, param = case
    started = time.perf_counter()
    assert_error_object(send(server, method, path, body, headers), status, param)
    assert time.perf_counter() - started < 5
    assert_serves(server)
    assert_no_live_blocks(server.engine)


def test_oversized_body_without_content_length(server: ServerThread) -> None:
    def chunks():
        yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
        for _ in range(100):
            yield b"x" * 1024
        yield b'"}]}'

    response = httpx.post(server.root_url + CHAT, content=chunks(), headers={"content-type": "application/json"})
    assert_error_object(response, 413)
    assert_serves(server)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES])
def test_a_body_that_is_not_json_is_refused_saying_where(server: ServerThread, path: str) -> None:
    """Not FastAPI's `28: JSON decode error` naming the offset as the param: no field is at fault."""
    for body, message in ((b'{"model": "x", "messages": [', "Expecting value at line 1 column 29"),
                          (b'{\n  "model": "x",\n  "input": "hi",\n}',
                           "Expecting property name enclosed in double quotes at line 4 column 1")):
        error = assert_error_object(send(server, "POST", path, body, {}), 400)
        assert error == {"message": f"the body is not valid JSON: {message}", "type": "invalid_request_error",
                         "param": None, "code": None}


def test_a_request_template_renders_when_allowed(server: ServerThread) -> None:
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    response = httpx.post(server.root_url + CHAT, json=chat(chat_template=template, logprobs=True), timeout=30)
    assert response.status_code == 200
    expected = server.engine.tokenizer.encode("[user] hi\n")
    assert response.json()["usage"]["prompt_tokens"] == len(expected)


def test_request_templates_are_off_by_default(tiny4k: LoadedModel) -> None:
    with ServerThread(tiny4k, MODEL) as srv:
        response = httpx.post(srv.root_url + CHAT, json=chat(chat_template="{{ messages }}"))
        assert "allow-request-chat-template" in assert_error_object(response, 400, "chat_template")["message"]


def test_a_burst_fills_the_free_slots_and_the_queue_and_a_request_that_never_fits_is_a_400(
        tiny4k: LoadedModel) -> None:
    """Arriving before the engine's next step, --max-num-seqs requests take its free slots and
    --max-queued-requests more wait; the next is busy (429). The queue once counted the burst's first ones as
    waiting, and admitted half. A request of more sequences than slots and queue together can never run: 400."""
    engine = start_engine(tiny4k, max_num_seqs=4, max_queued_requests=4)
    client = EngineClient(engine)
    params = SamplingParams(max_tokens=2)

    async def scenario() -> None:
        with pytest.raises(RequestError, match="9 sequences"):
            client.submit([[5] * 4] * 3, params, n=3)
        streams = client.submit([[5] * 4] * 2, params, n=3)  # 6 on an idle server: 4 run, 2 wait
        streams += [submit(engine, [5] * 4, params) for _ in range(2)]
        with pytest.raises(ServerBusyError):
            submit(engine, [5] * 4, params)
        for stream in streams:
            async for _ in stream:
                pass

    try:
        asyncio.run(scenario())
        assert_no_live_blocks(engine)
    finally:
        engine.stop()


def test_flood_gets_429_with_retry_after_and_leaks_nothing(tiny4k: LoadedModel) -> None:
    async def flood(url: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=100)) as client:
            body = chat(max_tokens=64, ignore_eos=True)
            return await asyncio.gather(*(client.post(url, json=body) for _ in range(40)))

    with ServerThread(tiny4k, MODEL, max_num_seqs=2, max_queued_requests=4) as srv:
        responses = asyncio.run(flood(srv.root_url + CHAT))
        busy = [r for r in responses if r.status_code == 429]
        done = [r for r in responses if r.status_code == 200]
        assert busy and done and len(busy) + len(done) == len(responses)
        for r in busy:
            assert r.headers["retry-after"] and assert_error_object(r, 429)["code"] == "server_busy"
        assert all(r.json()["usage"]["completion_tokens"] == 64 for r in done)
        wait_until_idle(srv)
        assert_no_live_blocks(srv.engine)
        assert_serves(srv)


def wait_until_idle(srv: ServerThread, seconds: float = 10) -> None:
    deadline = time.time() + seconds
    while srv.engine.num_unfinished and time.time() < deadline:
        time.sleep(0.02)
    assert srv.engine.num_unfinished == 0


@pytest.mark.parametrize("n", [1, 3])
def test_a_non_streaming_client_that_leaves_aborts_its_sequences(server: ServerThread, n: int) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.root_url + CHAT, json=chat(max_tokens=4000, ignore_eos=True, n=n), timeout=0.3)
    wait_until_idle(server)
    assert_no_live_blocks(server.engine)
    assert_serves(server)


def test_a_streaming_client_with_n_2_that_leaves_aborts_both(server: ServerThread) -> None:
    with httpx.stream("POST", server.root_url + CHAT, json=chat(max_tokens=4000, ignore_eos=True, n=2, stream=True),
                      timeout=30) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    wait_until_idle(server)
    assert_no_live_blocks(server.engine)


def test_api_keys(tiny4k: LoadedModel) -> None:
    with ServerThread(tiny4k, MODEL, ServerConfig(api_key=("key-one", "key-two"))) as srv:
        assert httpx.get(srv.root_url + "/health").status_code == 200  # open to probes
        error = assert_error_object(httpx.get(srv.root_url + "/v1/models"), 401)
        assert error["code"] == "invalid_api_key"
        assert_error_object(httpx.get(srv.root_url + "/v1/models", headers={"Authorization": "Bearer nope"}), 401)
        assert_error_object(httpx.get(srv.root_url + "/metrics", headers={"Authorization": "key-one"}), 401)
        assert_error_object(httpx.post(srv.root_url + CHAT, json=chat()), 401)
        for key in ("key-one", "key-two"):
            client = openai.OpenAI(base_url=srv.root_url + "/v1", api_key=key)
            assert client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2).usage.completion_tokens
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.root_url + "/v1", api_key="wrong").models.list()


def test_cors_is_off_unless_origins_are_allowed(server: ServerThread, tiny4k: LoadedModel) -> None:
    preflight = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST"}
    response = httpx.options(server.root_url + CHAT, headers=preflight)
    assert "access-control-allow-origin" not in response.headers
    with ServerThread(tiny4k, MODEL, ServerConfig(allowed_origins=("http://ui.example",), api_key=("k",))) as srv:
        response = httpx.options(srv.root_url + CHAT, headers=preflight)
        assert response.status_code == 200
        assert response.headers["access-control-allow-origin"] == "http://ui.example"
        response = httpx.get(srv.root_url + "/v1/models", headers={"Origin": "http://ui.example",
                                                                     "Authorization": "Bearer k"})
        assert response.status_code == 200 and response.headers["access-control-allow-origin"]


def test_a_dead_engine_is_unhealthy_and_refuses_work(tiny4k: LoadedModel) -> None:
    engine = start_engine(tiny4k)
    engine.stop()
    client = TestClient(create_app(engine, MODEL))  # no lifespan: the engine stays dead
    assert client.get("/health").status_code == 503
    assert_error_object(client.post(CHAT, json=chat()), 503)


def test_a_dead_engine_stops_the_server(tiny4k: LoadedModel) -> None:
    with ServerThread(tiny4k, MODEL) as srv:
        srv.engine.stop()
        srv.thread.join(timeout=10)
        assert not srv.thread.is_alive() and srv.server.exit_code == 1
