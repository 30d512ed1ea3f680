"""The command line: flags generated from the config dataclasses, API keys from flags or the environment."""

from __future__ import annotations

import argparse
import dataclasses
import socket
import subprocess
import sys

import pytest

from tokenmill.cli import _pick, build_parser, main, with_env_api_keys
from tokenmill.config import FLAG_GROUPS, EngineConfig, ServerConfig
from tokenmill.errors import ConfigError


def test_flags_fill_the_configs() -> None:
    args = build_parser().parse_args(["serve", "--api-key", "a", "--api-key", "b", "m.gguf", "--no-prefix-caching",
                                      "--max-queued-requests", "5", "--shutdown-timeout", "1.5"])
    server, engine = _pick(ServerConfig, args), _pick(EngineConfig, args)
    assert args.model == ["m.gguf"]  # a key flag takes one value: the model after it is not swallowed
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


def _fails_at_start(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """What `tokenmill ...` prints when it refuses to start: one line, exit code 2, no traceback."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize(("flags", "said"), [
    (["--kv", "pagd"], "argument --kv: invalid choice: 'pagd'"),
    (["--log-level", "bogus"], "argument --log-level: invalid choice: 'bogus'"),
    (["--speculative", "eagle"], "argument --speculative: invalid choice: 'eagle'"),
    (["--tool-call-parser", "mistral"], "argument --tool-call-parser: invalid choice: 'mistral'"),
    (["--kv-cache-dtype", "int4"], "argument --kv-cache-dtype: invalid choice: 'int4'"),
])
def test_a_value_outside_a_flags_choices_is_refused_by_the_parser(flags: list[str], said: str,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert said in _fails_at_start(["serve", *flags], capsys)


@pytest.mark.parametrize(("flags", "said"), [
    (["--port", "70000"], "tokenmill: --port 70000: a TCP port is 0 to 65535\n"),
    (["--host", "no-such-host.invalid"], "tokenmill: --host no-such-host.invalid: "),
    (["--speculative", "draft"], "tokenmill: --speculative draft needs --draft-model"),
    (["--draft-model", "d.gguf"], "tokenmill: --draft-model is read with --speculative draft only\n"),
    (["--kv-cache-memory", "lots"], "tokenmill: cannot read 'lots' as a size"),
    (["--deterministic", "--kv", "contiguous"], "tokenmill: --deterministic needs --kv paged"),
    (["--kv-cache-dtype", "int8", "--kv", "contiguous"], "tokenmill: --kv-cache-dtype int8 needs --kv paged"),
    (["--prompt-lookup-min", "4", "--prompt-lookup-max", "2"],
     "tokenmill: --prompt-lookup-min 4 --prompt-lookup-max 2: "),
    (["--max-num-batched-tokens", "0"], "tokenmill: --max-num-batched-tokens 0: at least 1\n"),
])
def test_settings_that_cannot_work_are_refused_before_the_model_loads(flags: list[str], said: str,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """The model named does not exist: had it been loaded first, that would have been the error. Before, a port
    out of range was a traceback, and --kv, --speculative and the draft flags were refused after the model loaded."""
    assert _fails_at_start(["serve", "/no/such/model.gguf", *flags], capsys).startswith(said)


def test_a_busy_port_is_refused_before_the_model_loads(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = _fails_at_start(["serve", "/no/such/model.gguf", "--port", str(port)], capsys)
    assert err == f"tokenmill: cannot listen on 127.0.0.1:{port}: Address already in use\n"


def test_ctrl_c_before_the_server_runs_exits_130_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C while the model loads was a traceback, then an abort as the interpreter tore down the loading thread."""
    import tokenmill.cli as cli

    def interrupted(*args: object) -> int:
        raise KeyboardInterrupt

    def exit_now(code: int) -> None:
        raise SystemExit(code)

    monkeypatch.setattr(cli, "serve", interrupted)
    monkeypatch.setattr(cli.os, "_exit", exit_now)
    with pytest.raises(SystemExit) as exit_:
        try:
            main(["serve", "m.gguf"])
        except KeyboardInterrupt:  # not let through: pytest would take it for its own Ctrl-C and stop the run
            pytest.fail("the KeyboardInterrupt escaped")
    assert exit_.value.code == 130
    assert capsys.readouterr().err == "tokenmill: interrupted\n"


def test_the_help_says_each_default_once() -> None:
    """A help that says its default in words (--max-model-len: the model's) no longer adds "(default: None)"."""
    serve = next(a for a in build_parser()._actions if a.dest == "command").choices["serve"]
    helps = {a.dest: a.help or "" for a in serve._actions}
    generated = " (default: %(default)s)"
    assert helps["max_num_seqs"].endswith(generated) and helps["max_model_len"].endswith("at most 8192)")
    twice = [dest for dest, text in helps.items() if text.endswith(generated) and "default" in text[:-len(generated)]]
    assert not twice


def test_configs_made_in_code_are_checked_as_the_flags_are() -> None:
    """Library callers (Engine, create_app) get the CLI's refusals: the configs check themselves."""
    with pytest.raises(ConfigError, match="^--kv pagd: choose paged or contiguous$"):
        EngineConfig(kv="pagd").check()
    with pytest.raises(ConfigError, match="^--tool-call-parser mistral: choose hermes, smollm2 or llama3_json$"):
        ServerConfig(tool_call_parser="mistral").check()
    EngineConfig(speculative=None).check()  # an optional choice may be left out
    ServerConfig(tool_call_parser=None).check()


def _choices(cls: type, name: str) -> list[str]:
    return sorted(next(f for f in dataclasses.fields(cls) if f.name == name).metadata["choices"])


def test_the_choices_of_a_flag_are_those_its_reader_knows() -> None:
    """The config names them without importing their owners (the API's parsers; torch, for the dtypes): each list
    is held equal to its owner's."""
    from tokenmill.api.tools.parsers import PARSERS
    from tokenmill.backend import DTYPES
    from tokenmill.layers.kv_quant import KV_CACHE_DTYPES

    assert _choices(ServerConfig, "tool_call_parser") == sorted(PARSERS)
    assert _choices(EngineConfig, "dtype") == sorted(["auto", *DTYPES])
    assert _choices(EngineConfig, "kv_cache_dtype") == sorted(KV_CACHE_DTYPES)


def test_the_early_sockets_take_the_port_as_a_running_server_does() -> None:
    """Two servers started together: the second is refused at once, though neither has loaded its model yet (a
    socket that only binds, SO_REUSEADDR set, does not take the port)."""
    from tokenmill.api.server import listen

    [first] = listen("127.0.0.1", 0)
    try:
        port = first.getsockname()[1]
        with pytest.raises(ConfigError, match=f"^cannot listen on 127.0.0.1:{port}: Address already in use$"):
            listen("127.0.0.1", port)
    finally:
        first.close()
    everywhere = listen("", 0)  # every interface, as asyncio binds host None: IPv4, and IPv6 on its own
    try:
        families = {s.family for s in everywhere}
        assert socket.AF_INET in families
        for s in everywhere:
            if s.family == socket.AF_INET6:
                assert s.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 1
    finally:
        for s in everywhere:
            s.close()


def test_every_flag_is_in_one_group_and_the_ab_switches_come_last() -> None:
    """`serve --help` shows the engine's and the server's flags in FLAG_GROUPS' order, each flag in one group."""
    fields = [f.name for cls in (EngineConfig, ServerConfig) for f in dataclasses.fields(cls)]
    grouped = [name for names in FLAG_GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(fields)
    [subcommands] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    text = subcommands.choices["serve"].format_help()
    titles = [line[:-1] for line in text.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert titles == ["positional arguments", "options", *FLAG_GROUPS]
    last = text[text.index("A/B switches and kernel tuning:"):]
    assert "  --prefix-caching, --no-prefix-caching" in last and "  --gpu-pdl" in last
    assert "  --max-num-seqs" not in last
