"""The command line: flags generated from the config dataclasses, API keys from flags or the environment."""

from __future__ import annotations

import pytest

from tokenmill.cli import _pick, build_parser, with_env_api_keys
from tokenmill.config import EngineConfig, ServerConfig


def test_flags_fill_the_configs() -> None:
    args = build_parser().parse_args(["serve", "--api-key", "a", "--api-key", "b", "m.gguf", "--no-prefix-caching",
                                      "--max-queued-requests", "5", "--shutdown-timeout", "1.5"])
    server, engine = _pick(ServerConfig, args), _pick(EngineConfig, args)
    assert args.model == "m.gguf"  # a key flag takes one value: the model after it is not swallowed
    assert server.api_key == ("a", "b") and server.shutdown_timeout == 1.5 and server.allowed_origins == ()
    assert engine.max_queued_requests == 5 and engine.prefix_caching is False
    assert _pick(ServerConfig, build_parser().parse_args(["serve"])).api_key == ()


def test_api_keys_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_API_KEY", " k1, k2 ,,")
    assert with_env_api_keys(ServerConfig()).api_key == ("k1", "k2")
    assert with_env_api_keys(ServerConfig(api_key=("flag",))).api_key == ("flag",)  # the flag wins
    monkeypatch.delenv("TOKENMILL_API_KEY")
    assert with_env_api_keys(ServerConfig()).api_key == ()
