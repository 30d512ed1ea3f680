"""A sparse mixture-of-experts MLP: a router picks each token's top-k of num_experts SwiGLU experts.

Tokens are grouped by expert, not looped over: the step's (token, choice) pairs are sorted by expert once, each
expert that any token chose runs one matmul over its tokens, and the weighted outputs are summed back with
index_add_. The experts' weights are stacked [experts, ...] tensors (dense: GGUF's quantized expert tensors are
dequantized at load).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class StackedWeight(nn.Module):
    """One stacked parameter, named like a Linear's (`.weight`), so the loader's names and fusing apply."""

    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape))


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        # Every expert's gate, then every expert's up ([2 * experts, intermediate, hidden]: the loader stacks the
        # checkpoint's gate_proj and up_proj along dim 0, as for a dense MLP's gate_up_proj), and their down.
        self.gate_up_proj = StackedWeight(2 * num_experts, intermediate, hidden)
        self.down_proj = StackedWeight(num_experts, hidden, intermediate)


class SparseMoE(nn.Module):
    """renormalize: the chosen experts' weights scaled to sum to 1."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, renormalize: bool) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.gate = nn.Linear(hidden, num_experts, bias=False)  # the router
        self.experts = Experts(num_experts, hidden, intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Routing in fp32 whatever the compute dtype (as transformers does): softmax over all experts, top-k.
        probs = self.gate(x).float().softmax(dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = chosen.flatten()
        order = flat.argsort(stable=True)  # the (token, choice) pairs grouped by expert
        tokens = order // self.top_k
        scales = weights.to(x.dtype).flatten()[order, None]
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        stacked = self.experts.gate_up_proj.weight
        gate_up = stacked.view(2, self.num_experts, *stacked.shape[1:])
        down = self.experts.down_proj.weight
        out = torch.zeros_like(x)
        start = 0
        for expert, n in enumerate(counts):
            if not n:
                continue
            rows = tokens[start:start + n]
            h = x[rows]
            h = F.silu(F.linear(h, gate_up[0, expert])) * F.linear(h, gate_up[1, expert])
            out.index_add_(0, rows, F.linear(h, down[expert]) * scales[start:start + n])
            start += n
        return out
