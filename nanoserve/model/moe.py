"""The mixture-of-experts MLP of a sparse layer: route each row, group the rows by expert, run
each expert's gated MLP once over the rows routed to it, and sum a row's experts in a fixed order.

Owns: the router (softmax over every expert in float32, top-k, the top-k weights renormalised
where the family does it: `config.Experts`), the grouping, the sum, and Qwen2-MoE's shared
expert (every row, scaled by the sigmoid of its own gate). The matrix multiplies, the router's
included, run through the model's linear kernel (`linear` and `activate` are the decoder's),
so the native kernels run the experts too. The loop runs every expert's gate_up and activation,
then every expert's down: under tensor parallelism on GGUF blocks (`gather`) the experts' width
slices are gathered once between the two, and each rank computes its output columns whole.

Batch invariance: a row's output is the sum of its experts' outputs in ascending expert index,
each added once into a zeroed row (`index_add_` over distinct rows), whatever else was routed
beside it; each expert's rows go through a batch-invariant linear kernel, and everything else
is per row (softmax and top-k over one row's logits, elementwise products). So a row's bits do
not depend on which rows share its step, nor on which experts they chose. Transformers sums in
the same order (its loop over the experts hit), so the float32 forwards agree closely too.

Native: where the layer's experts are native matrices (any layout the native stages take,
nanoserve.native.stage_matrix: float32 or F16 / BF16 panels, the repacked x8 and K layouts of a
Q4_K_M or IQ4_XS file, stacks of those), the router, the top-k, the grouping, the experts and
the sum run as one native call (`nanoserve.native.moe`: given the same routing, the bits of this
loop through those kernels; its own routing agrees with `route` to the last bits of the weights); the
shared expert stays here. In a Llama stack (Mixtral) the one-call decoder runs that call's
code as a stage of its step (`nanoserve.native.decoder`), and this block is not called.

Host read: the loop splits the rows by each expert's count, read on the host (`tolist`): on
the CPU that is no transfer; on CUDA it is one sync per sparse layer (nanoserve has no fused
MoE kernel for CUDA that would avoid it).

Profile: with `tally` set, each expert's routed rows and the wall time of its matmuls are
added up (summed over the sparse layers), by the loop or by the native call.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from nanoserve.config import Experts
from nanoserve.model.weights import MoEWeights
from nanoserve.native.moe import NativeExperts
from nanoserve.quant import Weight

Linear = Callable[[torch.Tensor, Weight], torch.Tensor]
Activate = Callable[[torch.Tensor], torch.Tensor]  # gate_up [rows, 2 * width] -> [rows, width]
Gather = Callable[[torch.Tensor], torch.Tensor]  # [rows, cols] on each rank -> [rows, ranks * cols]


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

    @property
    def starts(self) -> list[int]:
        return [0, *itertools.accumulate(self.counts)][:-1]


def group_by_expert(routing: Routing, num_experts: int) -> ExpertGroups:
    top_k = routing.experts.shape[1]
    flat = routing.experts.reshape(-1)
    order = flat.argsort(stable=True)  # stable: rows stay ascending within an expert
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return ExpertGroups(order // top_k, routing.weights.reshape(-1)[order], counts)


@dataclass(slots=True)
class ExpertTally:
    """Per expert, summed over sparse layers and calls: rows routed to it, seconds in its matmuls."""

    rows: torch.Tensor  # int64 [experts]
    seconds: torch.Tensor  # float64 [experts]
    calls: int = field(default=0)  # sparse-layer calls counted

    @classmethod
    def zeros(cls, count: int) -> ExpertTally:
        return cls(torch.zeros(count, dtype=torch.int64), torch.zeros(count, dtype=torch.float64))


class MixtureOfExperts:
    """A sparse layer's MLP over a flat batch of rows (`spec`: what the config says). `activate`:
    the gate's activation times up, of a gate_up product [rows, 2 * width]."""

    def __init__(self, spec: Experts, linear: Linear, activate: Activate, *,
                 threads: int | None = None) -> None:
        """`threads`: the native experts' call's thread count (None: `native.thread_count`'s)."""
        self.spec = spec
        self.threads = threads
        self.linear = linear
        self.activate = activate
        self.tally: ExpertTally | None = None  # set by the profile

    def __call__(self, x: torch.Tensor, weights: MoEWeights, native: NativeExperts | None = None,
                 gather: Gather | None = None) -> torch.Tensor:
        """Each row's routed experts (and shared expert), summed: [rows, hidden], or with `gather`
        this rank's columns of it. `native`: the routing and experts as one native call (with
        `gather`, its routing and then the loop), else the loop.
        `gather`: the down projections split by output across tensor-parallel ranks (each rank's
        slice of every expert's width gathered whole before its down); None: one rank, or the
        ranks' partial sums reduced by the caller."""
        tally = self.tally
        if tally is not None:
            tally.calls += 1
        if native is not None and gather is None:
            out, _, _ = native.routed(x, expert_rows=None if tally is None else tally.rows,
                                      expert_seconds=None if tally is None else tally.seconds,
                                      threads=self.threads)
        else:  # (split by output, the ranks route as the native call does, to its bits)
            routing = Routing(*native.route(x, threads=self.threads)) if native is not None else route(
                self.linear(x, weights.router), self.spec)
            out = self._loop(x, routing, weights, gather)
        if weights.shared_gate_up is not None:
            # The gate is one value a row, so float32 sigmoid takes torch's vector path for a
            # crowd and its scalar path for a lone row, a last bit apart; in float64 the two
            # differ far below what the rounding to float32 keeps.
            gate = torch.sigmoid(self.linear(x, weights.shared_gate).double()).to(x.dtype)
            activated = self.activate(self.linear(x, weights.shared_gate_up))
            shared = self.linear(activated if gather is None else gather(activated), weights.shared_down)
            out += gate * shared
        return out

    def _loop(self, x: torch.Tensor, routing: Routing, weights: MoEWeights,
              gather: Gather | None) -> torch.Tensor:
        """Every expert's gate_up and activation over its rows, then (gathered across ranks when
        split by output) every expert's down, each row's outputs added in ascending expert index."""
        groups = group_by_expert(routing, self.spec.count)
        spans = zip(groups.starts, groups.counts, strict=True)
        hit = [(e, start, count) for e, (start, count) in enumerate(spans) if count]
        seconds = {}
        activated = []
        for expert, start, count in hit:
            begun = time.perf_counter()
            rows = groups.rows[start:start + count]
            activated.append(self.activate(self.linear(x[rows], weights.gate_up[expert])))
            seconds[expert] = time.perf_counter() - begun
        if gather is not None and hit:  # one gather for every expert's rows
            activated = list(gather(torch.cat(activated)).split([count for _, _, count in hit]))
        out = x.new_zeros(x.shape[0], weights.down[0].shape[0])
        for (expert, start, count), expert_activated in zip(hit, activated, strict=True):
            begun = time.perf_counter()
            routed = self.linear(expert_activated, weights.down[expert])
            seconds[expert] += time.perf_counter() - begun
            scale = groups.weights[start:start + count, None].to(x.dtype)
            out.index_add_(0, groups.rows[start:start + count], routed * scale)
        if self.tally is not None:
            for expert, _, count in hit:
                self.tally.rows[expert] += count
                self.tally.seconds[expert] += seconds[expert]
        return out
