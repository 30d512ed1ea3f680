"""The command line: flags generated from the config dataclasses, API keys from flags or the environment."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tokenmill.cli import _pick, build_parser, main, with_env_api_keys
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


def test_serving_never_imports_the_bench() -> None:
    """The bench's modules and its extra (httpx, matplotlib) load only for `tokenmill bench`."""
    code = ("import sys, tokenmill.cli as cli; cli.build_parser().parse_args(['serve', 'm.gguf']); "
            "print([m for m in sys.modules if m.startswith(('tokenmill.bench', 'httpx', 'matplotlib'))])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("missing", ["httpx", "matplotlib"])
def test_bench_without_its_extra_says_how_to_install_it(missing: str, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture) -> None:
    for module in ("tokenmill.bench.client", "tokenmill.bench.report", "matplotlib.figure"):  # imported afresh
        monkeypatch.delitem(sys.modules, module, raising=False)
        parent, _, name = module.rpartition(".")
        if parent in sys.modules:
            monkeypatch.delattr(sys.modules[parent], name, raising=False)
    monkeypatch.setitem(sys.modules, missing, None)  # import raises ModuleNotFoundError, as when not installed
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--workload", "burst"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (f"tokenmill: bench needs {missing}, which is not installed: "
                                       f"pip install 'tokenmill[bench]'\n")


def test_chat_says_when_its_server_cannot_be_reached(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(SystemExit) as exit_:
        main(["chat", "--url", f"http://127.0.0.1:{port}/v1"])  # no model named: it asks the server for one
    assert exit_.value.code == 1
    assert f"tokenmill chat: cannot reach http://127.0.0.1:{port}/v1" in capsys.readouterr().err
