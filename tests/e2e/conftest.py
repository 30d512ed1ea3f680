"""The live server most end-to-end modules talk to: the default model (SmolLM2-135M, loaded as `tokenmill serve`
loads it) behind the real HTTP stack, one per module. Modules that serve another model or other settings define
their own `server`."""

from __future__ import annotations

import openai
import pytest
from helpers import ServerThread, openai_client

from tokenmill.loader import LoadedModel


@pytest.fixture(scope="module")
def server(smollm_served: LoadedModel):
    with ServerThread(smollm_served, "smollm2-135m", max_num_seqs=8) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai_client(server)
