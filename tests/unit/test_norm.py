"""RMSNorm through the C++ kernel (kernels/norm.cpp) computes what torch's does; add_and_norm adds first."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill import kernels
from tokenmill.layers.norm import RMSNorm

pytestmark = pytest.mark.skipif(not kernels.load(), reason="the C++ kernels do not build here")


@pytest.mark.parametrize("dim", [96, 100])  # whole vectors of squares, and a tail past them
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_norms_as_torch_does(dtype: torch.dtype, dim: int) -> None:
    norm = RMSNorm(dim, 1e-5)
    norm.weight.data = torch.randn(dim).to(dtype)
    x = (torch.randn(5, dim) * 3).to(dtype)
    expected = F.rms_norm(x.float(), (dim,), norm.weight.float(), 1e-5)
    ours = norm(x)
    assert ours.dtype == dtype and ours.shape == x.shape
    assert torch.allclose(ours.float(), expected, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)
    heads = torch.randn(3, 4, dim)[:, 1:3]  # a strided view, as q/k norms see after the split
    assert torch.allclose(norm(heads.to(dtype)).float(), F.rms_norm(heads.to(dtype).float(), (dim,),
                          norm.weight.float(), 1e-5), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_and_norm_writes_the_sum_into_the_stream(dtype: torch.dtype) -> None:
    norm = RMSNorm(64, 1e-6)
    stream, branch = torch.randn(3, 64).to(dtype), torch.randn(3, 64).to(dtype)
    expected_sum = stream + branch
    total, normed = norm.add_and_norm(stream, branch)
    assert total is stream and torch.equal(stream, expected_sum)  # rounded as x + residual is
    assert torch.allclose(normed.float(), F.rms_norm(expected_sum.float(), (64,), eps=1e-6),
                          rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)
