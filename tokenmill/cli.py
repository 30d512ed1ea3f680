"""`tokenmill serve [MODEL]`, `tokenmill chat [MODEL | --url URL]`, `tokenmill pull ALIAS`, `tokenmill bench` and
`tokenmill keys add TENANT --file FILE`."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import types
import typing
from collections.abc import Collection

from tokenmill import __version__
from tokenmill.config import FLAG_GROUPS, LOG_LEVELS, EngineConfig, ServerConfig
from tokenmill.errors import ConfigError, ModelFormatError


def _add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, skip: Collection[str] = ()) -> None:
    """One --flag per dataclass field, typed and defaulted by the field itself, in its group (FLAG_GROUPS)."""
    hints = typing.get_type_hints(cls)
    groups = {title: _group(parser, title) for title in FLAG_GROUPS}
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        # a field of another dataclass (the bench's) goes with the parser's own options
        group = next((groups[title] for title, names in FLAG_GROUPS.items() if f.name in names), parser)
        kind = hints[f.name]
        if isinstance(kind, types.UnionType):  # `int | None` -> int
            kind = next(t for t in typing.get_args(kind) if t is not type(None))
        flag, help_ = f"--{f.name.replace('_', '-')}", f.metadata.get("help", "")
        if "default" not in help_:  # a help that says its default in words keeps those words only
            help_ += " (default: %(default)s)"
        if kind is bool:  # --flag / --no-flag
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_)
        elif typing.get_origin(kind) is tuple:  # tuple[str, ...]: one value per flag, repeated for several
            default = list(typing.cast(tuple, f.default))
            group.add_argument(flag, action="append", type=typing.get_args(kind)[0], default=default, help=help_)
        else:
            group.add_argument(flag, type=kind, default=f.default, choices=f.metadata.get("choices"), help=help_)


def _group(parser: argparse.ArgumentParser, title: str) -> argparse._ArgumentGroup:
    """The parser's group of that title, made the first time (engine and server flags share some titles)."""
    for group in parser._action_groups:
        if group.title == title:
            return group
    return parser.add_argument_group(title)


def _pick(cls: type, args: argparse.Namespace) -> typing.Any:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


API_KEY_HELP = "the server's API key (default: the first of $TOKENMILL_API_KEY)"


def _env_api_key() -> str | None:
    return os.environ.get("TOKENMILL_API_KEY", "").split(",")[0].strip() or None


def build_parser(bench_flags: bool = False) -> argparse.ArgumentParser:
    """bench_flags: give `bench` its flags, which imports tokenmill.bench (main does for `tokenmill bench` only)."""
    parser = argparse.ArgumentParser(prog="tokenmill", description="An OpenAI-compatible LLM server.")
    parser.add_argument("--version", action="version", version=f"tokenmill {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over the OpenAI API")
    serve.add_argument("model", nargs="*", default=[],
                       help="the models to serve, each a .gguf file, a Hugging Face folder, a hub id or an alias "
                            f"(default: {EngineConfig.model}, or those of --models-file)")
    _add_dataclass_flags(serve, EngineConfig, skip={"model"})
    _add_dataclass_flags(serve, ServerConfig)
    chat = sub.add_parser("chat", help="chat in the terminal, with MODEL in this process or a server at --url")
    chat.add_argument("model", nargs="?", help=f"the model to load (default: {EngineConfig.model}); with --url, "
                                                "the model to ask for (default: the server's first)")
    chat.add_argument("--url", help="a running OpenAI-compatible server's base URL, e.g. http://127.0.0.1:8000/v1")
    chat.add_argument("--api-key", default=_env_api_key(), help=API_KEY_HELP)
    chat.add_argument("--system", help="a system prompt")
    chat.add_argument("--temperature", type=float, help="(default: the server's)")
    chat.add_argument("--max-tokens", type=int, help="longest reply (default: the rest of the context)")
    chat.add_argument("--log-level", default="warning", choices=LOG_LEVELS, help="(default: %(default)s)")
    _add_dataclass_flags(chat, EngineConfig, skip={"model"})
    pull = sub.add_parser("pull", help="fetch an embedded default model into the cache")
    pull.add_argument("alias")
    keys = sub.add_parser("keys", help="manage the keys file of --api-keys")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    add = keys_sub.add_parser("add", help="make a new key for a tenant (its table made where it has none): the key "
                                          "is printed once, only its hash is written to the file")
    add.add_argument("tenant", help="the tenant's name: letters, digits, '_', '.' or '-'")
    add.add_argument("--file", required=True, help="the keys file (made where it does not exist)")
    add.add_argument("--role", choices=["user", "admin"], default="user", help="a new tenant's role "
                     "(default: %(default)s)")
    bench = sub.add_parser("bench", help="benchmark any OpenAI-compatible server (see docs/performance/bench.md)")
    if bench_flags:
        _add_bench_flags(bench)
    return parser


def _add_bench_flags(bench: argparse.ArgumentParser) -> None:
    from tokenmill.bench.workloads import WORKLOADS, WorkloadParams

    bench.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the server's OpenAI base URL "
                       "(default: %(default)s)")
    bench.add_argument("--model", help="the model to ask for (default: the first id of /v1/models); several, "
                       "comma-separated (LoRA adapters, a server's models): the requests take them in turn")
    bench.add_argument("--api-key", default=_env_api_key(), help=API_KEY_HELP)
    bench.add_argument("--workload", choices=WORKLOADS)
    bench.add_argument("--endpoint", choices=["chat", "completions"], default="chat", help="(default: %(default)s)")
    bench.add_argument("--concurrency", type=int, help="requests in flight at most (default: 1 for baseline, "
                       "else all)")
    bench.add_argument("--ignore-eos", action="store_true", help="send ignore_eos, so outputs run to --output-len")
    bench.add_argument("--temperature", type=float, default=0.0, help="(default: %(default)s)")
    bench.add_argument("--top-p", type=float, default=1.0, help="sent where below 1 (default: %(default)s)")
    bench.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default: %(default)s)")
    bench.add_argument("--warmup", type=int, default=1, help="untimed requests first (default: %(default)s)")
    _add_dataclass_flags(bench, WorkloadParams, skip={"name"})
    bench.add_argument("--json", metavar="PATH", help="write the report as JSON")
    bench.add_argument("--plot", metavar="PATH", help="write latency histograms and throughput over time as PNG")
    bench.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), help="print two reports side by side")
    bench.add_argument("--log-level", default="warning", choices=LOG_LEVELS, help="(default: %(default)s)")


def with_env_api_keys(config: ServerConfig) -> ServerConfig:
    """The keys of --api-key, or else those of $TOKENMILL_API_KEY (comma-separated)."""
    if config.api_key:
        return config
    keys = tuple(k.strip() for k in os.environ.get("TOKENMILL_API_KEY", "").split(",") if k.strip())
    return dataclasses.replace(config, api_key=keys)


def serve(engine_config: EngineConfig, server_config: ServerConfig, models: list[str] | None = None) -> int:
    """Serve until SIGTERM (exit code 0) or until an engine dies (1). models: the MODEL arguments (none: the
    models file's, or engine_config.model)."""
    from tokenmill.api.app import open_tenancy
    from tokenmill.api.response_store import open_store
    from tokenmill.api.server import build_server, listen
    from tokenmill.config import parse_size
    from tokenmill.hosting.pool import ModelPool
    from tokenmill.hosting.specs import specs_from_args

    log = logging.getLogger(__name__)
    server_config = with_env_api_keys(server_config)
    if not (server_config.api_key or server_config.api_keys) and \
            server_config.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("serving on %s without an API key: anyone who can reach it can use it (--api-key)",
                    server_config.host)
    # Before the model loads, so that a mistyped flag or a busy port is said at once (the engine checks its settings
    # again, for those who build one in code).
    engine_config.check()
    server_config.check()
    if engine_config.node_rank > 0:  # another host's tensor-parallel ranks: host 0 serves the API
        from tokenmill.engine.tensor_parallel import run_node

        return run_node(engine_config)
    specs = specs_from_args(models or [], engine_config, server_config)
    listeners = listen(server_config.host, server_config.port)
    store = open_store(server_config)
    tenancy = open_tenancy(server_config, store)  # a keys file with a mistake stops the start, naming its line
    budget = parse_size(server_config.max_memory) if server_config.max_memory else None
    pool = ModelPool(specs, budget, server_config.model_load_timeout)
    pool.preload()  # the models that fit, in order, each on its engine thread
    server = build_server(pool, server_config, store=store, tenancy=tenancy, graceful_timeout=5)
    log.info("serving %s on http://%s:%d/v1", ", ".join(s.name for s in specs), server_config.host,
             listeners[0].getsockname()[1])
    server.run(sockets=listeners)
    return server.exit_code


def _bench_main() -> typing.Callable[[argparse.Namespace], int]:
    """tokenmill bench's entry point, or a clear exit where the `bench` extra is not installed."""
    try:
        from tokenmill.bench.client import main as bench_main
    except ModuleNotFoundError as exc:
        package = (exc.name or "").split(".")[0]
        if package not in ("httpx", "matplotlib"):  # pyproject.toml's `bench` extra
            raise
        print(f"tokenmill: bench needs {package}, which is not installed: pip install 'tokenmill[bench]'",
              file=sys.stderr)
        sys.exit(2)
    return bench_main


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(bench_flags=argv[:1] == ["bench"]).parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "info").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "pull":
            from tokenmill.loader.sources import pull

            print(pull(args.alias))
        elif args.command == "serve":
            models, args.model = args.model, (args.model or [EngineConfig.model])[0]
            sys.exit(serve(_pick(EngineConfig, args), _pick(ServerConfig, args), models))
        elif args.command == "chat":
            from tokenmill.chat import main as chat_main

            asked, args.model = args.model, args.model or EngineConfig.model
            sys.exit(chat_main(_pick(EngineConfig, args), args.url, args.api_key, asked, args.system,
                               args.temperature, args.max_tokens))
        elif args.command == "bench":
            sys.exit(_bench_main()(args))
        elif args.command == "keys":
            from pathlib import Path

            from tokenmill.tenants.keys import add_key

            key = add_key(Path(args.file), args.tenant, args.role)
            print(key)
            print(f"tokenmill: a new key of {args.tenant}, its hash written to {args.file}; the key is shown only "
                  "this once", file=sys.stderr)
    except (ModelFormatError, ConfigError) as exc:
        print(f"tokenmill: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # Ctrl-C before the server runs (it handles its own), e.g. while the model loads
        print("tokenmill: interrupted", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(130)  # not sys.exit: the engine thread may be inside torch's loading code, which teardown aborts
