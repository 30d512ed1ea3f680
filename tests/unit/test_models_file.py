"""The models a server hosts, from its arguments or a models file: each model's settings, and each mistake refused
at start naming the file's line."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import write_tiny_gguf

from tokenmill.cli import main
from tokenmill.config import EngineConfig, ServerConfig, parse_keep_alive
from tokenmill.errors import ConfigError
from tokenmill.hosting.specs import read_models_file, specs_from_args
from tokenmill.loader.sources import cache_dir


@pytest.mark.parametrize(("value", "seconds"), [("5m", 300.0), ("1h30m", 5400.0), ("500ms", 0.5), ("30", 30.0),
                                                (0, 0.0), (2.5, 2.5), ("-1", None), (-1, None), ("-5m", None)])
def test_keep_alive_reads_as_ollama_reads_it(value: object, seconds: float | None) -> None:
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["soon", "5 m", "m5", "", True, None, [1], "nan"])
def test_a_keep_alive_that_is_no_duration_is_refused(value: object) -> None:
    with pytest.raises(ConfigError, match="keep_alive"):
        parse_keep_alive(value)


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    return write_tiny_gguf(tmp_path / "tiny.gguf")


def test_a_models_file_gives_each_model_its_settings_over_the_flags(tmp_path: Path, model_file: Path) -> None:
    file = tmp_path / "models.toml"
    file.write_text(f'''
[[models]]
source = "{model_file}"
name = "small"
aliases = ["s", "tiny"]
dtype = "float32"
max_model_len = 256
keep_alive = "10m"
tool_call_parser = "hermes"

[[models]]
source = "tiny.gguf"  # relative to the file
kv_cache_memory = "8MiB"
lora = ["sql=adapters/sql", "other=/elsewhere/other"]
chat_template = "t.jinja"
draft_model = "tiny.gguf"
speculative = "draft"
''')
    (tmp_path / "adapters" / "sql").mkdir(parents=True)
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    defaults = EngineConfig(threads=1, max_num_seqs=8)
    first, second = read_models_file(file, defaults, keep_alive=None)
    assert (first.name, first.aliases, first.keep_alive, first.tool_call_parser) == \
        ("small", frozenset({"s", "tiny"}), 600.0, "hermes")
    assert (first.engine.dtype, first.engine.max_model_len, first.engine.threads, first.engine.max_num_seqs) == \
        ("float32", 256, 1, 8)
    assert second.name == "tiny.gguf" and second.engine.model == str(model_file) and second.keep_alive is None
    assert second.engine.kv_cache_memory == "8MiB" and second.engine.dtype == "auto"
    assert second.engine.lora == (f"sql={tmp_path / 'adapters' / 'sql'}", "other=/elsewhere/other")
    assert second.engine.chat_template == str(tmp_path / "t.jinja") and second.engine.draft_model == str(model_file)


@pytest.mark.parametrize(("body", "line", "said"), [
    ('[[models]]\nsource = "{m}"\ncolour = "red"\n', 3, "unknown key 'colour'"),
    ('[[models]]\nsource = "{m}"\n\n[[models]]\nname = "x"\nsource = "/no/such/model.gguf"\n', 6,
     "/no/such/model.gguf: no such file or folder"),
    ('[[models]]\nsource = "{m}"\nmax_num_seqs = "lots"\n', 3, "max_num_seqs = 'lots': expected an integer"),
    ('[[models]]\nsource = "{m}"\nmax_num_seqs = 0\n', 1, "--max-num-seqs 0: at least 1"),
    ('[[models]]\nsource = "{m}"\nkeep_alive = "soon"\n', 3, "keep_alive 'soon'"),
    ('[[models]]\nsource = "{m}"\ntool_call_parser = "mistral"\n', 3, "tool_call_parser 'mistral'"),
    ('[[models]]\nsource = "{m}"\naliases = "one"\n', 3, "aliases = 'one': not a list of names"),
    ('[[models]]\nsource = "{m}"\naliases = [""]\n', 3, "aliases: a list of names"),
    ('[[models]]\nsource = "{m}"\nprefix_caching = "yes"\n', 3, "prefix_caching = 'yes': expected true or false"),
    ('[[models]]\nsource = "{m}"\nprefix_caching = 1\n', 3, "prefix_caching = 1: expected true or false"),
    ('[[models]]\nsource = "{m}"\nmax_num_seqs = true\n', 3, "max_num_seqs = True: expected an integer"),
    ('[[models]]\nsource = "{m}"\nmax_model_len = 2.5\n', 3, "max_model_len = 2.5: expected an integer"),
    ('[[models]]\nsource = "{m}"\nkv_cache_memory = 5\n', 3, "kv_cache_memory = 5: expected a string"),
    ('[[models]]\nsource = "{m}"\nlora = "a=b"\n', 3, "lora = 'a=b': expected"),
    ('[[models]]\nsource = "{m}"\nlora = [1]\n', 3, "lora = [1]: expected"),
    ('[[models]]\nsource = "{m}"\n"dtype" = "nope"\n', 1, "--dtype nope: choose"),
    ('name = "x"\n[[models]]\nsource = "{m}"\n', 0, "unknown top-level"),
    ('[[models]]\nname = "x"\n', 1, "no source"),
    ('[[models]]\nsource = "{m}"\ndtype = "float32\n', 3, "Illegal character"),
    ('[[models]]\nsource = "{m}"\nmodel = "other.gguf"\n', 3, "unknown key 'model'"),
])
def test_a_mistake_in_a_models_file_is_refused_with_its_line(tmp_path: Path, model_file: Path, body: str, line: int,
                                                             said: str) -> None:
    file = tmp_path / "models.toml"
    file.write_text(body.replace("{m}", str(model_file)))
    with pytest.raises(ConfigError) as refused:
        read_models_file(file, EngineConfig(), None)
    assert (f"line {line}" in str(refused.value) or not line) and said in str(refused.value)


@pytest.mark.parametrize(("body", "said"), [
    ("", "no [[models]] table"),
    ('model = "x"\n', "unknown top-level key(s) model"),
    ('[[models]]\nsource = "{m}"\nname = "a"\n[[models]]\nsource = "{m}"\nname = "b"\naliases = ["a"]\n',
     "two models are called 'a' (a and b)"),
])
def test_a_models_file_without_models_or_with_a_name_twice_is_refused(tmp_path: Path, model_file: Path, body: str,
                                                                       said: str) -> None:
    file = tmp_path / "models.toml"
    file.write_text(body.replace("{m}", str(model_file)))
    with pytest.raises(ConfigError, match=said.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        read_models_file(file, EngineConfig(), None)


def test_models_as_arguments_answer_to_their_paths_too(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    a, b = write_tiny_gguf(tmp_path / "a.gguf"), write_tiny_gguf(tmp_path / "b" / "a.gguf", seed=1)
    first, second = specs_from_args([str(a), str(b)], EngineConfig(), ServerConfig())
    assert first.names == {str(a)} and second.names == {str(b)}  # "a.gguf" is both files' name: neither's alias
    (one,) = specs_from_args([str(a)], EngineConfig(), ServerConfig(served_model_name="mine"))
    assert one.names == {"mine", str(a), "a.gguf"}
    (alias,) = specs_from_args(["smollm2-135m"], EngineConfig(), ServerConfig())
    assert alias.names == {"smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.gguf",
                           str(cache_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf")}  # pulled or not
    with pytest.raises(ConfigError, match="--served-model-name names one model"):
        specs_from_args([str(a), str(b)], EngineConfig(), ServerConfig(served_model_name="mine"))
    with pytest.raises(ConfigError, match="two models are called"):
        specs_from_args([str(a), str(a)], EngineConfig(), ServerConfig())


def test_serve_refuses_a_models_file_pointing_at_a_missing_file_before_anything_loads(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "models.toml"
    file.write_text('[[models]]\nsource = "gone.gguf"\n')
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--models-file", str(file), "--port", "0"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip() == f"tokenmill: {file}, line 2: gone.gguf: no such file or folder"
    with pytest.raises(SystemExit):
        main(["serve", "m.gguf", "--models-file", str(file)])
    assert "not both" in capsys.readouterr().err
