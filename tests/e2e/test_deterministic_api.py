"""The issue's own trial through the openai SDK: the same seeded chat request, sent to a fresh --deterministic server
three times (cold, then with its prompt in the prefix cache) and once more beside other users, gives one answer;
the server says it runs deterministic."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from helpers import ServerThread, openai_client

from tokenmill import __version__, kernels
from tokenmill.config import WeightPlan
from tokenmill.loader import load_model

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not kernels.load(), reason="deterministic mode needs the C++ kernels")]
MODEL = "smollm2-135m"
ASK = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story about a lighthouse keeper."}],
       "temperature": 0.9, "seed": 123, "max_tokens": 48}


@pytest.fixture(scope="module")
def client(smollm_path: Path):
    loaded = load_model(str(smollm_path), WeightPlan(dtype="float32", device="cpu", deterministic=True))
    with ServerThread(loaded, MODEL, deterministic=True) as srv:
        yield openai_client(srv)


def test_the_same_seeded_request_gets_the_same_answer_cold_cached_and_in_company(client: openai.OpenAI) -> None:
    answers = [client.chat.completions.create(**ASK) for _ in range(3)]
    others = [{**ASK, "messages": [{"role": "user", "content": f"Count to {n} in words."}], "seed": n,
               "max_tokens": 8 * n} for n in range(2, 9)]
    with ThreadPoolExecutor(8) as pool:  # the request again, alongside seven others that come and go
        jobs = [pool.submit(client.chat.completions.create, **ASK)]
        jobs += [pool.submit(client.chat.completions.create, **other) for other in others]
        in_company = jobs[0].result()
        assert all(job.result().choices[0].finish_reason for job in jobs[1:])
    texts = [a.choices[0].message.content for a in [*answers, in_company]]
    assert len(set(texts)) == 1 and len(texts[0]) > 40
    assert answers[1].usage.prompt_tokens_details.cached_tokens > 0  # the second one found its prompt cached
    assert {a.system_fingerprint for a in answers} == {f"tokenmill-{__version__}-float32-deterministic"}


def test_n_choices_are_the_requests_of_seed_plus_i(client: openai.OpenAI) -> None:
    both = client.chat.completions.create(**{**ASK, "n": 2})  # two sequences sharing every step
    alone = [client.chat.completions.create(**{**ASK, "seed": ASK["seed"] + i}) for i in range(2)]
    assert [c.message.content for c in both.choices] == [a.choices[0].message.content for a in alone]
    assert both.choices[0].message.content != both.choices[1].message.content


def test_streams_and_the_model_card_say_deterministic(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, stream=True))
    assert {c.system_fingerprint for c in chunks} == {f"tokenmill-{__version__}-float32-deterministic"}
    assert client.models.retrieve(MODEL).model_extra["deterministic"] is True
