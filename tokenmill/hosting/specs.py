"""What a server hosts: one ModelSpec per model, from `serve MODEL [MODEL ...]` or a models file (TOML), each with
its served name(s), its own engine settings and how long it stays loaded while idle."""

from __future__ import annotations

import dataclasses
import re
import tomllib
import types
import typing
from dataclasses import dataclass
from pathlib import Path

from tokenmill.config import EngineConfig, ServerConfig, parse_keep_alive
from tokenmill.errors import ConfigError
from tokenmill.loader.sources import ALIASES, local_path, missing_source

# A models file's keys beside EngineConfig's fields (which it may set per model, `model` aside: that is `source`).
_OWN_KEYS = {"name": str, "source": str, "aliases": list, "keep_alive": (str, int, float),
             "tool_call_parser": str}
_ENGINE_KEYS = {f.name for f in dataclasses.fields(EngineConfig)} - {"model", "node_rank", "nnodes", "master_addr",
                                                                     "master_port"}


@dataclass(frozen=True)
class ModelSpec:
    """name: the id /v1/models lists; aliases: other names requests may use; keep_alive: seconds the model stays
    loaded once idle (None: until its memory is needed); tool_call_parser: its own, over the server's."""

    name: str
    engine: EngineConfig
    aliases: frozenset[str] = frozenset()
    keep_alive: float | None = None
    tool_call_parser: str | None = None

    @property
    def names(self) -> frozenset[str]:
        return self.aliases | {self.name}


def specs_from_args(models: list[str], engine: EngineConfig, server: ServerConfig) -> list[ModelSpec]:
    """The models of `serve MODEL [MODEL ...]` (or of --models-file), each with the flags' settings."""
    keep_alive = parse_keep_alive(server.keep_alive, "--keep-alive")
    if server.served_model_name and (len(models) > 1 or server.models_file):
        raise ConfigError("--served-model-name names one model; with several, give each its name in --models-file")
    if server.models_file:
        if models:
            raise ConfigError("give the models as arguments or in --models-file, not both")
        return read_models_file(Path(server.models_file), engine, keep_alive)
    models = models or [engine.model]
    names = [server.served_model_name or model for model in models]
    # each model also answers to its file's path and name, where no other model's does
    paths = [path_names(model) for model in models]
    shared = {n for i, p in enumerate(paths) for n in p if any(n in q for q in paths[:i] + paths[i + 1:])}
    specs = [ModelSpec(name, dataclasses.replace(engine, model=model), frozenset({model} | (p - shared)) - {name},
                       keep_alive) for model, name, p in zip(models, names, paths, strict=True)]
    check_names(specs)
    for spec in specs:
        spec.engine.check()
    return specs


def path_names(model: str) -> set[str]:
    """The path a model's file or folder has once resolved, and its name (an alias resolves into the cache)."""
    path = local_path(model)
    return {str(path), path.name} if path.exists() or model in ALIASES else set()


def check_names(specs: list[ModelSpec]) -> None:
    seen: dict[str, str] = {}
    for spec in specs:
        for name in sorted(spec.names):
            if name in seen:
                raise ConfigError(f"two models are called {name!r} ({seen[name]} and {spec.name})")
            seen[name] = spec.name


def read_models_file(path: Path, defaults: EngineConfig, keep_alive: float | None) -> list[ModelSpec]:
    """A models file: a [[models]] table per model (`source` and optionally `name`, `aliases`, `keep_alive`,
    `tool_call_parser`, and any engine setting by its flag's name with underscores); the command line's flags are
    every model's defaults. A mistake is refused naming the file and the line."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"--models-file {path}: {exc.strerror}") from exc
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    lines = _key_lines(text)
    extra = set(document) - {"models"}
    if extra:
        raise ConfigError(f"{path}: unknown top-level key(s) {', '.join(sorted(extra))}: each model is a [[models]] "
                          "table")
    tables = document.get("models")
    if not isinstance(tables, list) or not tables:
        raise ConfigError(f"{path}: no [[models]] table: name at least one model")
    specs = []
    for index, table in enumerate(tables):
        where = lines.get((index, None), 0)

        def fail(message: str, key: str | None = None, where: int = where, index: int = index) -> typing.NoReturn:
            line = lines.get((index, key), where) if key else where
            raise ConfigError(f"{path}, line {line}: {message}")

        specs.append(_spec(table, defaults, keep_alive, fail, path.parent))
    try:
        check_names(specs)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return specs


def _spec(table: dict, defaults: EngineConfig, keep_alive: float | None, fail: typing.Callable[..., typing.NoReturn],
          folder: Path) -> ModelSpec:
    hints = typing.get_type_hints(EngineConfig)
    for key, value in table.items():
        if key in _OWN_KEYS:
            if not isinstance(value, _OWN_KEYS[key]):  # type: ignore[arg-type]
                fail(f"{key} = {value!r}: not a {'list of names' if key == 'aliases' else 'valid value'}", key)
        elif key in _ENGINE_KEYS:
            if not _fits(value, hints[key]):
                fail(f"{key} = {value!r}: expected {_type_name(hints[key])}", key)
        else:
            fail(f"unknown key {key!r} (a model takes source, name, aliases, keep_alive, tool_call_parser and the "
                 "engine's settings by their flags' names, with underscores)", key)
    if "source" not in table:
        fail("this model has no source (a .gguf file, a Hugging Face folder, a hub id or an alias)")
    source = _beside(folder, table["source"])
    if (reason := missing_source(source)) is not None:
        fail(reason, "source")
    settings = {k: v for k, v in table.items() if k in _ENGINE_KEYS}
    for key in ("chat_template", "draft_model"):
        if isinstance(settings.get(key), str):
            settings[key] = _beside(folder, settings[key])
    if "lora" in settings:
        settings["lora"] = tuple(f"{entry.partition('=')[0]}={_beside(folder, entry.partition('=')[2])}"
                                 for entry in settings["lora"])
    engine = dataclasses.replace(defaults, model=source, **settings)
    try:
        engine.check()
    except ConfigError as exc:
        fail(str(exc))
    aliases = table.get("aliases", [])
    if not all(isinstance(a, str) and a for a in aliases):
        fail("aliases: a list of names", "aliases")
    name = table.get("name") or table["source"]
    try:
        own_keep_alive = parse_keep_alive(table["keep_alive"]) if "keep_alive" in table else keep_alive
    except ConfigError as exc:
        fail(str(exc), "keep_alive")
    parser = table.get("tool_call_parser")
    choices = next(f for f in dataclasses.fields(ServerConfig) if f.name == "tool_call_parser").metadata["choices"]
    if parser is not None and parser not in choices:
        fail(f"tool_call_parser {parser!r}: choose {', '.join(choices)}", "tool_call_parser")
    return ModelSpec(name, engine, frozenset(aliases) - {name}, own_keep_alive, parser)


def _beside(folder: Path, path: str) -> str:
    """A path of the file's, read from the file's folder where it is relative and there (as a user who writes the
    file next to the models expects); otherwise as given."""
    return str(folder / path) if path and not Path(path).is_absolute() and (folder / path).exists() else path


def _fits(value: object, hint: object) -> bool:
    for option in _options(hint):
        if option is bool and isinstance(value, bool):
            return True
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        if option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if option is str and isinstance(value, str):
            return True
        if typing.get_origin(option) is tuple and isinstance(value, list) and all(isinstance(v, str) for v in value):
            return True
    return False


def _type_name(hint: object) -> str:
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return " or ".join(names.get(o, str(o)) for o in _options(hint))  # type: ignore[call-overload]


def _options(hint: object) -> tuple[object, ...]:
    """The types a field's hint allows, None aside."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    return tuple(o for o in (typing.get_args(hint) if union else (hint,)) if o is not type(None))


def _key_lines(text: str) -> dict[tuple[int, str | None], int]:
    """Where each [[models]] table and each of its keys starts, by (table index, key); (index, None): the table's
    header. TOML's parser keeps no positions, so the lines are found in the text (keys of a table are one per line
    in any file a person writes)."""
    found: dict[tuple[int, str | None], int] = {}
    index = -1
    key = re.compile(r"\s*([A-Za-z0-9_-]+|\"[^\"]*\")\s*=")
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if stripped.startswith("[[") and stripped.removeprefix("[[").split("]]")[0].strip() == "models":
            index += 1
            found[(index, None)] = number
        elif index >= 0 and (match := key.match(line)):
            found.setdefault((index, match.group(1).strip('"')), number)
    return found

