"""A sparse mixture-of-experts MLP: a router picks each token's top-k of num_experts SwiGLU experts.

Tokens are grouped by expert, not looped over: the step's (token, choice) pairs are sorted by expert once, each
expert that any token chose runs one matmul over its tokens, and the weighted outputs are summed back with
index_add_. The experts' weights are stacked [experts, ...] tensors, or GGUF's quantized expert tensors kept as they
are (each expert's rows a slice of one QuantizedWeight, run by the quantized kernel).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.quantized import INTERLEAVE, QuantizedWeight


class StackedWeight(nn.Module):
    """One stacked parameter [items, out, in], named like a Linear's (`.weight`), so the loader's names and fusing
    apply; called with an item's index, it is that item's Linear."""

    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape))

    def forward(self, item: int, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight[item])


class QuantizedStacked(nn.Module):
    """StackedWeight's items as one QuantizedWeight of items * out rows: item i's rows are whole interleaved groups
    (out a multiple of INTERLEAVE, which the loader checks), so its slice is a view."""

    def __init__(self, weight: QuantizedWeight, items: int) -> None:
        super().__init__()
        self.weight, self.rows = weight, weight.out_features // items
        self.pairs = True  # as QuantizedLinear's
        assert self.rows % INTERLEAVE == 0 and self.rows * items == weight.out_features

    def forward(self, item: int, x: torch.Tensor) -> torch.Tensor:
        w, groups = self.weight, slice(item * self.rows // INTERLEAVE, (item + 1) * self.rows // INTERLEAVE)
        return torch.ops.tokenmill.quantized_linear(x, w.qweight[groups], w.scales[groups],
                                                    None if w.mins is None else w.mins[groups], w.sub, w.zero,
                                                    self.rows, pairs=self.pairs)


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        # Every expert's gate, then every expert's up ([2 * experts, intermediate, hidden]: the loader stacks the
        # checkpoint's gate_proj and up_proj along dim 0, as for a dense MLP's gate_up_proj), and their down.
        self.num_experts = num_experts
        self.gate_up_proj: StackedWeight | QuantizedStacked = StackedWeight(2 * num_experts, intermediate, hidden)
        self.down_proj: StackedWeight | QuantizedStacked = StackedWeight(num_experts, hidden, intermediate)

    def forward(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(expert, x), self.gate_up_proj(self.num_experts + expert, x)
        return self.down_proj(expert, F.silu(gate) * up)


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
        out = torch.zeros_like(x)
        start = 0
        for expert, n in enumerate(counts):
            if not n:
                continue
            rows = tokens[start:start + n]
            out.index_add_(0, rows, self.experts(expert, x[rows]) * scales[start:start + n])
            start += n
        return out
