"""The request guard as plain ASGI: what reaches the app, what is refused before it, and with which error."""

from __future__ import annotations

import asyncio
import json

import pytest

from tokenmill.api.errors import error_body, error_response
from tokenmill.api.guards import RequestGuard, ServingState, json_depth
from tokenmill.tenants.keys import hash_key
from tokenmill.tenants.tenancy import Tenancy

LIMIT = 64  # body bytes
DEPTH = 4


class App:
    """Records the body it was given and what the channel said after it; answers 200."""

    def __init__(self) -> None:
        self.body: bytes | None = None
        self.after_body: str | None = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            chunks = []
            while True:
                message = await receive()
                assert message["type"] == "http.request", message
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    break
            self.body = b"".join(chunks)
            self.after_body = (await receive())["type"]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def call(guard: RequestGuard, body: bytes = b"{}", method: str = "POST", path: str = "/v1/chat/completions",
         headers: dict[str, str] | None = None, chunk: int | None = None, declare_length: bool = True,
         client_leaves: bool = False, messages: list[dict] | None = None) -> tuple[int, dict, dict]:
    """One request through the guard: (status, JSON error or {}, response headers). messages: the ASGI messages
    of the body as given (default: body in chunks of chunk bytes)."""
    pieces = [body[i:i + chunk] for i in range(0, len(body), chunk)] if chunk else [body]
    if messages is None:
        messages = [{"type": "http.request", "body": p, "more_body": i < len(pieces) - 1}
                    for i, p in enumerate(pieces)]
    if client_leaves:
        messages = messages[:1]
        messages[0]["more_body"] = True
    messages.append({"type": "http.disconnect"})
    head = {k.lower(): v for k, v in (headers or {}).items()}
    if declare_length:
        head.setdefault("content-length", str(len(body)))
    scope = {"type": "http", "method": method, "path": path,
             "headers": [(k.encode(), v.encode()) for k, v in head.items()]}
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0)

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(guard(scope, receive, send))
    start = sent[0]
    payload = b"".join(m.get("body", b"") for m in sent[1:])
    error = json.loads(payload)["error"] if start["status"] != 200 else {}
    return start["status"], error, {k.decode(): v.decode() for k, v in start["headers"]}


def guard(keys: tuple[str, ...] = (), state: ServingState | None = None, tenancy: Tenancy | None = None
          ) -> tuple[RequestGuard, App]:
    app = App()
    tenancy = tenancy or Tenancy(None, keys)
    return RequestGuard(app, state or ServingState(), tenancy, max_body_bytes=LIMIT, max_json_depth=DEPTH), app


def padded(size: int) -> bytes:
    """A valid JSON body of exactly size bytes."""
    body = b'{"a": ""}'
    return body[:-2] + b"x" * (size - len(body)) + body[-2:]


@pytest.mark.parametrize("text,depth", [
    ("", 0), ("1", 0), ('"[[["', 0), ("{}", 1), ("[]", 1), ('{"a": [1, {"b": []}]}', 4), ('[[], [[]], []]', 3),
    ('{"a": "]]]]"}', 1), ('{"a": "\\"[[[", "b": [[]]}', 3), ('["\\\\", ["]"]]', 2), ("[" * 40 + "]" * 40, 40),
])
def test_json_depth_counts_brackets_outside_strings(text: str, depth: int) -> None:
    assert json_depth(text.encode()) == depth


@pytest.mark.parametrize("declare_length,chunk", [(True, None), (False, 7)])
def test_a_body_of_exactly_the_limit_passes_whole_and_one_byte_more_is_413(declare_length: bool, chunk) -> None:
    g, app = guard()
    assert call(g, padded(LIMIT), declare_length=declare_length, chunk=chunk)[0] == 200
    assert app.body == padded(LIMIT) and app.after_body == "http.disconnect"  # then the real channel
    g, app = guard()
    status, error, _ = call(g, padded(LIMIT + 1), declare_length=declare_length, chunk=chunk)
    assert status == 413 and error == {"message": f"the request body is larger than {LIMIT} bytes",
                                       "type": "invalid_request_error", "param": None, "code": "request_too_large"}
    assert app.body is None


def test_a_declared_length_over_the_limit_is_refused_before_the_body_is_read() -> None:
    g, app = guard()
    assert call(g, b"{}", headers={"content-length": str(LIMIT + 1)})[0] == 413 and app.body is None


def test_the_optional_keys_of_a_body_message_take_their_asgi_defaults() -> None:
    g, app = guard()
    assert call(g, messages=[{"type": "http.request"}], declare_length=False)[0] == 200 and app.body == b""
    g, app = guard()
    assert call(g, messages=[{"type": "http.request", "body": b"[1]"}])[0] == 200 and app.body == b"[1]"


def test_a_false_small_content_length_does_not_get_a_large_body_through() -> None:
    g, app = guard()
    status, _, _ = call(g, padded(LIMIT + 1), headers={"content-length": "2"}, chunk=8)
    assert status == 413 and app.body is None


def test_nesting_of_exactly_the_limit_passes_and_one_level_more_is_400() -> None:
    g, app = guard()
    assert call(g, b'{"a": [[[1]]]}')[0] == 200 and app.body == b'{"a": [[[1]]]}'
    g, app = guard()
    status, error, _ = call(g, b'{"a": [[[[1]]]]}')
    assert status == 400 and error == {"message": f"the request body nests deeper than {DEPTH} levels",
                                       "type": "invalid_request_error", "param": None, "code": None}
    assert app.body is None


def test_a_client_that_leaves_while_sending_gets_nothing_run() -> None:
    g, app = guard()
    status, error, _ = call(g, padded(40), chunk=10, client_leaves=True)
    assert status == 400 and error == {"message": "the client went away", "type": "invalid_request_error",
                                       "param": None, "code": None}
    assert app.body is None


@pytest.mark.parametrize("header,status", [
    (None, 401), ("Bearer k1", 200), ("Bearer k2", 200), ("bearer k1", 200), ("Bearer  k1 ", 200),
    ("Bearer k3", 401), ("Bearer k1k2", 401), ("Bearer ", 401), ("Basic k1", 401), ("k1", 401), ("Bearerk1", 401),
])
def test_api_keys(header: str | None, status: int) -> None:
    g, app = guard(keys=("k1", "k2"))
    got, error, _ = call(g, headers={"Authorization": header} if header is not None else {})
    assert got == status
    if status == 401:
        assert error == {"message": "Incorrect or missing API key: send it as `Authorization: Bearer KEY`.",
                         "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}
        assert app.body is None


def test_health_is_open_and_gets_requests_are_not_read() -> None:
    g, app = guard(keys=("k1",))
    assert call(g, method="GET", path="/health", body=b"")[0] == 200
    assert call(g, method="GET", path="/v1/models", body=b"")[0] == 401
    g, app = guard()
    assert call(g, method="GET", path="/v1/models", body=b"[[[[[[[[", declare_length=False)[0] == 200


@pytest.mark.parametrize("method", ["PUT", "PATCH"])
def test_every_method_with_a_body_is_checked(method: str) -> None:
    g, _ = guard()
    assert call(g, padded(LIMIT + 1), method=method)[0] == 413


def test_draining_refuses_new_requests_but_not_health() -> None:
    state = ServingState()
    g, app = guard(state=state)
    state.draining = True
    status, error, headers = call(g)
    assert status == 503 and error == {"message": "the server is shutting down", "type": "service_unavailable",
                                       "param": None, "code": None}
    assert headers["retry-after"] == "5" and headers["connection"] == "close"
    assert call(g, method="GET", path="/health", body=b"")[0] == 200  # /health answers 503 itself
    state.draining = False
    assert call(g)[0] == 200


def test_other_scopes_pass_through() -> None:
    g, app = guard(keys=("k1",))
    sent = []

    async def send(message) -> None:
        sent.append(message)

    asyncio.run(g({"type": "lifespan"}, None, send))
    assert sent[0]["status"] == 200


def test_error_objects() -> None:
    assert error_body("m", "t") == {"error": {"message": "m", "type": "t", "param": None, "code": None}}
    response = error_response(429, "m", "t", "p", "c", headers={"Retry-After": "1"})
    assert response.status_code == 429 and response.headers["retry-after"] == "1"
    assert json.loads(response.body) == {"error": {"message": "m", "type": "t", "param": "p", "code": "c"}}


def tenants(tmp_path, **alice) -> Tenancy:
    settings = "".join(f"{k} = {v}\n" for k, v in alice.items())
    path = tmp_path / "keys.toml"
    keys = "".join(f'[[keys]]\ntenant = "{name}"\nsha256 = "{hash_key(key)}"\n'
                   for name, key in (("alice", "a-key"), ("root", "r-key")))
    path.write_text(f"[tenants.alice]\n{settings}\n[tenants.root]\nrole = \"admin\"\n\n{keys}")
    return Tenancy(path)


@pytest.mark.parametrize("path", ["/metrics", "/stats", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"])
def test_the_admin_routes_refuse_a_user_key(tmp_path, path: str) -> None:
    g, app = guard(tenancy=tenants(tmp_path))
    method = "POST" if "lora" in path else "GET"
    status, error, _ = call(g, method=method, path=path, headers={"Authorization": "Bearer a-key"})
    assert status == 403 and error["code"] == "admin_only" and app.body is None
    assert call(g, method=method, path=path, headers={"Authorization": "Bearer r-key"})[0] == 200
    assert call(g, method="GET", path="/v1/models", body=b"", headers={"Authorization": "Bearer a-key"})[0] == 200


def test_requests_per_minute_are_counted_at_the_edge_with_the_headers_on_every_response(tmp_path) -> None:
    g, app = guard(tenancy=tenants(tmp_path, requests_per_minute=2, tokens_per_minute=50))
    alice = {"Authorization": "Bearer a-key"}
    status, _, headers = call(g, headers=alice)
    assert status == 200 and headers["x-ratelimit-limit-requests"] == "2"
    assert headers["x-ratelimit-remaining-requests"] == "1" and headers["x-ratelimit-remaining-tokens"] == "50"
    assert headers["x-ratelimit-reset-requests"].endswith("s")
    assert call(g, method="GET", path="/v1/models", body=b"", headers=alice)[0] == 200  # a GET is not counted
    assert call(g, headers=alice)[0] == 200
    status, error, headers = call(g, headers=alice)
    assert status == 429 and error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
    assert headers["x-ratelimit-remaining-requests"] == "0" and 59 <= int(headers["retry-after"]) <= 60
    assert int(headers["retry-after-ms"]) > 58_000
    assert call(g, headers={"Authorization": "Bearer r-key"})[0] == 200  # another tenant's limits are its own


def test_concurrent_requests_are_released_when_a_request_ends(tmp_path) -> None:
    tenancy = tenants(tmp_path, max_concurrent_requests=1)
    g, app = guard(tenancy=tenancy)
    alice = {"Authorization": "Bearer a-key"}
    assert call(g, headers=alice)[0] == 200 and call(g, headers=alice)[0] == 200  # one at a time: each ends
    limits = tenancy.limits(tenancy.ring.tenants["alice"])
    limits.admit()  # one in flight elsewhere
    status, error, _ = call(g, headers=alice)
    assert status == 429 and "concurrent" in error["message"]
    limits.done()
    assert call(g, headers=alice)[0] == 200 and limits.in_flight == 0
