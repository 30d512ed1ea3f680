"""The shape the code keeps (docs/design.md, "Who owns which decision"): small functions given their settings
whole, a step that reads as its six calls, one place that sets a finish reason."""

from __future__ import annotations

import ast
from pathlib import Path

import tokenmill

PACKAGE = Path(tokenmill.__file__).parent


def functions(path: Path) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def test_no_function_takes_more_than_8_parameters_but_the_triton_kernels_and_their_launchers() -> None:
    def count(f: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
        a = f.args
        names = [x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]] + [x.arg for x in (a.vararg, a.kwarg) if x]
        return len([n for n in names if n not in ("self", "cls")])

    found = [f"{path.relative_to(PACKAGE)}:{f.lineno} {f.name}: {count(f)}" for path in sorted(PACKAGE.rglob("*.py"))
             if not path.is_relative_to(PACKAGE / "kernels") for f in functions(path) if count(f) > 8]
    assert found == []


def test_the_engine_step_reads_in_a_screenful() -> None:
    [step] = [f for f in functions(PACKAGE / "engine" / "engine.py") if f.name == "_step"]
    assert step.end_lineno is not None and step.end_lineno - step.lineno + 1 <= 30


def test_only_the_scheduler_s_finish_sets_a_finish_reason() -> None:
    """The output side and the engine report why a sequence ends; Scheduler.finish records it."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for f in functions(path):
            for node in ast.walk(f):
                targets = node.targets if isinstance(node, ast.Assign) else \
                    [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else []
                if any(isinstance(t, ast.Attribute) and t.attr == "finish_reason" for t in targets):
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} in {f.name}")
    assert [where.split(" in ")[1] for where in found] == ["finish"] and found[0].startswith("engine/scheduler.py")
