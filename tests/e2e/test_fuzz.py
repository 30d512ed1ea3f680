"""Fuzzing the HTTP API from its own OpenAPI schema with schemathesis: valid and invalid requests alike, no 5xx."""

from __future__ import annotations

import os

import pytest
import schemathesis
from helpers import ServerThread, assert_no_live_blocks, write_tiny_gguf
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from tokenmill.config import WeightPlan
from tokenmill.loader import load_model

EXAMPLES = int(os.environ.get("TOKENMILL_FUZZ_EXAMPLES", "60"))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    path = write_tiny_gguf(tmp_path_factory.mktemp("fuzz") / "tiny.gguf")
    # A short context keeps generated max_tokens cheap; most generated prompts are then refused as too long.
    with ServerThread(load_model(str(path), WeightPlan(dtype="float32", device="cpu")), "tiny",
                      max_model_len=96) as srv:
        yield srv


def _serve_model(case):
    """Ask for the served model: a random name is a 404 before any other field is looked at."""
    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = "tiny"
    return case


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_no_request_gets_a_5xx(server: ServerThread, mode: GenerationMode) -> None:
    schema = schemathesis.openapi.from_url(server.root_url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {f"{op.method.upper()} {op.path}" for op in operations} >= {"POST /v1/chat/completions",
                                                                       "POST /v1/completions", "GET /v1/models"}
    statuses: dict[int, int] = {}
    for operation in operations:
        if mode == GenerationMode.NEGATIVE and operation.method.upper() != "POST":
            continue  # nothing to get wrong in a GET without parameters
        @given(case=operation.as_strategy(generation_mode=mode).map(_serve_model))
        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        def call(case) -> None:
            response = case.call(timeout=30)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            assert response.status_code < 500, f"{case.method} {case.path} {case.body!r} -> {response.text}"
            if response.status_code >= 400:
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}

        call()
    # Both modes must get past the model name: positive mode to many 200s, negative mode to many 400s.
    assert statuses.get(200 if mode == GenerationMode.POSITIVE else 400, 0) > EXAMPLES // 4, statuses
    assert_no_live_blocks(server.engine)
