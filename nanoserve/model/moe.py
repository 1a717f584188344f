"""The mixture-of-experts MLP of a sparse layer: route each row, group the rows by expert, run
each expert's gated MLP once over the rows routed to it, and sum a row's experts in a fixed order.

Owns: the router (softmax over every expert in float32, top-k, the top-k weights renormalised
where the family does it: `config.Experts`), the grouping, the sum, and Qwen2-MoE's shared
expert (every row, scaled by the sigmoid of its own gate). The matrix multiplies, the router's
included, run through the model's linear kernel (`expert` and `linear` are the decoder's), so
the native kernels run the experts too.

Batch invariance: a row's output is the sum of its experts' outputs in ascending expert index,
each added once into a zeroed row (`index_add_` over distinct rows), whatever else was routed
beside it; each expert's rows go through a batch-invariant linear kernel, and everything else
is per row (softmax and top-k over one row's logits, elementwise products). So a row's bits do
not depend on which rows share its step, nor on which experts they chose. Transformers sums in
the same order (its loop over the experts hit), so the float32 forwards agree closely too.

Host read: the grouping splits the rows by each expert's count, read on the host (`tolist`):
on the CPU that is no transfer; on CUDA it is one sync per sparse layer (nanoserve has no fused
MoE kernel that would avoid it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanoserve.config import Experts
from nanoserve.model.weights import MoEWeights
from nanoserve.quant import Weight

Linear = Callable[[torch.Tensor, Weight], torch.Tensor]
GatedMLP = Callable[[torch.Tensor, Weight, Weight], torch.Tensor]  # (x, gate_up, down) -> out


@dataclass(frozen=True, slots=True)
class Routing:
    """Each row's top_k experts and their weights, [rows, top_k] both."""

    experts: torch.Tensor
    weights: torch.Tensor


def route(router_logits: torch.Tensor, spec: Experts) -> Routing:
    """Softmax over every expert in float32, the top_k, renormalised when the family says."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = torch.topk(probs, spec.top_k, dim=-1)
    if spec.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(experts, weights)


@dataclass(frozen=True, slots=True)
class ExpertGroups:
    """The step's (row, expert) pairs grouped by expert: `rows[starts[e]:starts[e + 1]]` are the
    rows routed to expert e, ascending, with their routing `weights` beside them."""

    rows: torch.Tensor
    weights: torch.Tensor
    counts: list[int]  # rows per expert, on the host: the one read the grouping needs


def group_by_expert(routing: Routing, num_experts: int) -> ExpertGroups:
    top_k = routing.experts.shape[1]
    flat = routing.experts.reshape(-1)
    order = flat.argsort(stable=True)  # stable: rows stay ascending within an expert
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return ExpertGroups(order // top_k, routing.weights.reshape(-1)[order], counts)


class MixtureOfExperts:
    """A sparse layer's MLP over a flat batch of rows (`spec`: what the config says)."""

    def __init__(self, spec: Experts, linear: Linear, expert: GatedMLP) -> None:
        self.spec = spec
        self.linear = linear
        self.expert = expert

    def __call__(self, x: torch.Tensor, weights: MoEWeights) -> torch.Tensor:
        groups = group_by_expert(route(self.linear(x, weights.router), self.spec), self.spec.count)
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(groups.counts):
            if count:
                rows = groups.rows[start:start + count]
                scale = groups.weights[start:start + count, None].to(x.dtype)
                routed = self.expert(x[rows], weights.gate_up[expert], weights.down[expert])
                out.index_add_(0, rows, routed * scale)
            start += count
        if weights.shared_gate_up is not None:
            # The gate is one value a row, so float32 sigmoid takes torch's vector path for a
            # crowd and its scalar path for a lone row, a last bit apart; in float64 the two
            # differ far below what the rounding to float32 keeps.
            gate = torch.sigmoid(self.linear(x, weights.shared_gate).double()).to(x.dtype)
            out += gate * self.expert(x, weights.shared_gate_up, weights.shared_down)
        return out
