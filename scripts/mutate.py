"""Mutation testing of one module with the tests that cover it (mutmut), and its score.

    bash scripts/dev.sh mutate MODULE [--max-children N]

MODULE is a short name below (or `all`). The run happens in .mutation/MODULE/, a copy of the package and tests
with its own mutmut settings, so the checkout is never touched. A mutant that survives is either a gap in the tests
(write the test that kills it) or equivalent to the original: then list it in tests/mutation_equivalents.toml with
the reason, matched by the function and the mutated line. The score excludes those.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EQUIVALENTS = ROOT / "tests" / "mutation_equivalents.toml"


@dataclass(frozen=True)
class Target:
    source: str
    tests: tuple[str, ...]


TARGETS = {
    "scheduler": Target("tokenmill/engine/scheduler.py", ("tests/unit/test_scheduler.py",
                                                          "tests/unit/test_structured.py",
                                                          "tests/unit/test_fair_share.py")),
    "tenant_keys": Target("tokenmill/tenants/keys.py", ("tests/unit/test_tenants.py",)),
    "tenant_limits": Target("tokenmill/tenants/limits.py", ("tests/unit/test_tenants.py",
                                                           "tests/unit/test_guards.py")),
    "usage": Target("tokenmill/tenants/usage.py", ("tests/unit/test_tenants.py",)),
    "tenancy": Target("tokenmill/tenants/tenancy.py", ("tests/unit/test_tenants.py", "tests/unit/test_guards.py")),
    "hf_quant": Target("tokenmill/loader/hf_quant.py", ("tests/model/test_hf_quantized.py",)),
    "kv_quant": Target("tokenmill/layers/kv_quant.py", ("tests/unit/test_kv_quant.py",)),
    "sharding": Target("tokenmill/parallel/sharding.py", ("tests/unit/test_parallel.py",)),
    "models_file": Target("tokenmill/hosting/specs.py", ("tests/unit/test_models_file.py",)),
    "pool": Target("tokenmill/hosting/pool.py", ("tests/e2e/test_many_models.py",)),
    "block_pool": Target("tokenmill/cache/block_pool.py", ("tests/unit/test_block_pool.py",)),
    "prefix_cache": Target("tokenmill/cache/prefix_cache.py", ("tests/unit/test_prefix_cache.py",)),
    "sampler": Target("tokenmill/engine/sampler.py", ("tests/unit/test_sampler.py", "tests/unit/test_structured.py")),
    "structured": Target("tokenmill/structured/backend.py", ("tests/unit/test_structured.py",)),
    "tool_parsers": Target("tokenmill/api/tools/parsers.py", ("tests/unit/test_tool_parsers.py",)),
    "guards": Target("tokenmill/api/guards.py", ("tests/unit/test_guards.py",)),
    "gguf": Target("tokenmill/loader/gguf.py", ("tests/unit/test_model_files.py",)),
    "chat_template": Target("tokenmill/loader/chat_template.py", ("tests/unit/test_chat_template.py",)),
    "responses_api": Target("tokenmill/api/responses_api.py", ("tests/unit/test_responses_translation.py",
                                                              "tests/unit/test_tools.py",
                                                              "tests/unit/test_response_store.py")),
    "response_store": Target("tokenmill/api/response_store.py", ("tests/unit/test_response_store.py",)),
    "kernels": Target("tokenmill/kernels/__init__.py", ("tests/unit/test_kernel_build.py",)),
    "spec": Target("tokenmill/engine/spec.py", ("tests/unit/test_spec.py", "tests/unit/test_engine_tiny.py")),
    "engine": Target("tokenmill/engine/engine.py", ("tests/unit/test_engine_tiny.py",)),
    "output": Target("tokenmill/engine/output.py", ("tests/unit/test_engine_tiny.py",)),
    "builder": Target("tokenmill/engine/builder.py", ("tests/unit/test_engine_tiny.py",)),
    "metrics": Target("tokenmill/engine/metrics.py", ("tests/unit/test_metrics_engine.py",
                                                    "tests/unit/test_dashboard_numbers.py")),
}


def _workdir(name: str, target: Target) -> Path:
    """A fresh copy of the package and tests, with mutmut set to mutate target.source only."""
    work = ROOT / ".mutation" / name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "tokenmill", work / "tokenmill", ignore=ignore)
    shutil.copytree(ROOT / "tests", work / "tests", ignore=ignore)
    settings = "\n".join([
        "", "[tool.mutmut]",
        'source_paths = ["tokenmill"]',
        f'only_mutate = ["{target.source}"]',
        f"pytest_add_cli_args_test_selection = {list(target.tests)!r}".replace("'", '"'),
        # the suite's per-test timeout would turn a slow mutant into a failure: mutmut has its own timeouts
        'pytest_add_cli_args = ["-p", "no:timeout", "-p", "no:cacheprovider", "-q"]',
        # torch's thread pools are not fork-safe: fork workers from a process that has not run any tests
        'process_isolation = "forkserver"',
        "use_git_change_detection = false",
    ])
    (work / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text() + settings + "\n")
    return work


def _mutmut(work: Path, *args: str) -> str:
    exe = Path(sys.executable).parent / "mutmut"
    done = subprocess.run([str(exe), *args], cwd=work, text=True, capture_output=True)
    if done.returncode != 0:
        log = work / "mutmut.log"
        log.write_text(done.stdout + done.stderr)
        sys.exit(f"mutmut {' '.join(args)} failed (exit {done.returncode}); its output is in {log}")
    return done.stdout


# mutmut's own diff of each mutant, for many mutants in one process (`mutmut show` takes one per process)
_DIFFS = """
import json, sys
from mutmut.mutation.diff_apply import get_diff_for_mutant
print(json.dumps({name: get_diff_for_mutant(name) for name in json.load(sys.stdin)}))
"""


def _diffs(work: Path, mutants: list[str]) -> dict[str, str]:
    done = subprocess.run([sys.executable, "-c", _DIFFS], cwd=work, input=json.dumps(mutants), text=True,
                          capture_output=True, check=True)
    return json.loads(done.stdout)


def _changed_lines(diff: str) -> tuple[str, str]:
    """The removed and added line of a mutant's diff, stripped."""
    minus = [line[1:].strip() for line in diff.splitlines() if line.startswith("-") and not line.startswith("---")]
    plus = [line[1:].strip() for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")]
    return " / ".join(minus), " / ".join(plus)


def _function(mutant: str) -> str:
    """tokenmill.engine.scheduler.xǁSchedulerǁschedule__mutmut_12 -> Scheduler.schedule"""
    name = mutant.rsplit(".", 1)[1].rsplit("__mutmut_", 1)[0]
    return ".".join(part for part in re.split("ǁ", name.removeprefix("x_").removeprefix("x")) if part)


def _equivalents(source: str) -> list[dict]:
    entries = tomllib.loads(EQUIVALENTS.read_text())["equivalent"]
    return [e for e in entries if e["source"] == source]


def mutate(name: str, max_children: int | None) -> tuple[int, int, int]:
    target = TARGETS[name]
    work = _workdir(name, target)
    print(f"== {name}: mutating {target.source} against {' '.join(target.tests)}", flush=True)
    _mutmut(work, "run", *([f"--max-children={max_children}"] if max_children else []))
    results = _mutmut(work, "results", "--all=true")
    statuses = dict(line.strip().rsplit(": ", 1) for line in results.splitlines() if ": " in line)
    equivalents = _equivalents(target.source)
    used = set()
    survivors = []
    alive = sorted(m for m, status in statuses.items() if status not in ("killed", "timeout"))
    diffs = _diffs(work, alive)
    for mutant in alive:
        status = statuses[mutant]
        removed, added = _changed_lines(diffs[mutant])
        match = next((i for i, e in enumerate(equivalents) if i not in used and e["function"] == _function(mutant)
                      and e["original"] == removed and e["mutant"] == added), None)  # each entry covers one mutant
        if match is not None:
            used.add(match)
            continue
        survivors.append((mutant, status, removed, added))
    total = len(statuses) - len(used)
    killed = total - len(survivors)
    for mutant, status, removed, added in survivors:
        print(f"  {status}: {mutant}\n      - {removed}\n      + {added}")
    for i, entry in enumerate(equivalents):
        if i not in used:
            print(f"  stale equivalent (no such surviving mutant now): {entry['function']}: {entry['mutant']}")
    timeouts = sum(status == "timeout" for status in statuses.values())
    print(f"== {name}: {killed}/{total} killed ({100 * killed / max(total, 1):.1f}%; {timeouts} of them by a "
          f"timeout), {len(used)} equivalent excluded", flush=True)
    return killed, total, len(used)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("module", choices=[*TARGETS, "all"])
    parser.add_argument("--max-children", type=int, default=None, help="parallel mutant runs (default: CPUs)")
    args = parser.parse_args()
    names = list(TARGETS) if args.module == "all" else [args.module]
    scores = {name: mutate(name, args.max_children) for name in names}
    if len(names) > 1:
        print("\n| module | killed / total | score | equivalent |\n|---|---|---|---|")
        for name, (killed, total, equivalent) in scores.items():
            print(f"| {TARGETS[name].source} | {killed} / {total} | {100 * killed / max(total, 1):.1f}% | "
                  f"{equivalent} |")


if __name__ == "__main__":
    main()
