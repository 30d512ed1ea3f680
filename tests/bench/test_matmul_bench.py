"""`python -m tokenmill.bench.matmul` on a tiny random model quantized to Q4_1: every matrix of its first layer and
the head at each row count, then every layer's matrices a pass, the one-row pass the unit of the ratios, then a
decode step's forward over a paged pool, alternated with a one-row one."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType
from helpers import write_tiny_gguf

from tokenmill import kernels
from tokenmill.bench import matmul


def test_the_matmul_bench_times_each_matrix_and_a_pass_of_every_layer(tmp_path: Path, monkeypatch,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    model = write_tiny_gguf(tmp_path / "q4.gguf", qtype=GGMLQuantizationType.Q4_1, hidden=256)
    monkeypatch.setattr(sys, "argv", ["matmul", str(model), "--rows", "1", "3", "--runs", "2", "--threads", "1",
                                      "--decode-fetch-ahead", "both"])
    matmul.main()
    out = capsys.readouterr().out
    lines = out.splitlines()
    matrices = [line for line in lines if line.startswith("model.layers.0.") or line.startswith("lm_head")]
    names = {line.split()[0] for line in matrices}
    assert {"model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj"} <= names
    assert len(matrices) == 2 * len(names)  # each at both row counts
    assert all(float(line.split()[-2]) > 0 for line in matrices)  # GOP/s
    start = lines.index(next(line for line in lines if line.startswith("every layer's"))) + 2
    passes = lines[start:start + 2]
    assert [p.split()[0] for p in passes] == ["1", "3"]
    assert passes[0].split()[-1] == "1.00"  # the one-row pass against itself
    assert float(passes[1].split()[-1]) > 0
    forward = lines[lines.index(next(line for line in lines if line.startswith("a decode step's forward"))) + 2:]
    assert [(f.split()[0], f.split()[-1]) for f in forward] == [("1", "off"), ("3", "off"), ("1", "on"), ("3", "on")]
    assert forward[0].split()[-2] == "1.00" and float(forward[1].split()[1]) > 0  # ms a step
    assert kernels.use_decode_fetch_ahead(True)  # turned back on after the off runs


def test_the_matmul_bench_refuses_a_model_without_kernel_matrices(tmp_path: Path, monkeypatch) -> None:
    model = write_tiny_gguf(tmp_path / "q4.gguf", qtype=GGMLQuantizationType.Q4_1, hidden=256)
    monkeypatch.setattr(kernels, "load", lambda: False)  # a machine where they did not build
    monkeypatch.setattr(sys, "argv", ["matmul", str(model), "--rows", "1", "--runs", "1"])
    with pytest.raises(SystemExit, match="no matrix runs on the C\\+\\+ kernels"):
        matmul.main()
