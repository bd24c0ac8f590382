"""Gradient handoff after a backward (GradHandoff): who owns each gradient a backward produced,
and until when. Shared by StepGraphs and its eager
twin EagerStep, so p.grad means the same with graphs on and off.

Gradients (GradHandoff): the captured backward writes each gradient into its own pool buffer,
rewritten by the next replay of that key; no AccumulateGrad runs. ANVIL banks take the graph's
buffer as p.grad (their reduce-scatter reads it before the next backward); Adam parameters,
stepped on the plan's Adam steps on the gradient summed since the last one, go through one
persistent accumulator per parameter: copy on the first micro-step of a step that opens an
accumulation window (the schedule's StepPlan.adam_first, given per step at construction), add on
every other micro-step, so the cadence is the plan's (not `p.grad is None`, which breaks when the
optimizer keeps .grad, and not a second `step % adam_every`). With micro_steps > 1 (fewer than 8
GPUs) ANVIL banks get persistent accumulators as well (copy on micro-step 0 of every step).

The n-gram sink gradient needs no handoff: the store adds it into its row accumulator right after
the backward, before the next replay rewrites the graph's buffer (perf/ngram_store.NgramStore.hold);
check_ngram_grad checks its shape at capture.

What must stay address-stable: the accumulators (StepGraphs.baked_tensors() lists them; the census
compares them around the post-warmup reset).

Provenance: record #360 `_CGraphRunner` (`_acc`), via the seed; its `_sink_flat` ring is not
needed here (the store sums each micro-step's n-gram gradient at once).
Legend: T tokens of a key, D n-gram row width.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from track_1_short.perf.cuda_graphs.capture_plan import StepGraphKey
from track_1_short.perf.cuda_graphs.capture_support import StepGraphError

if TYPE_CHECKING:
    from track_1_short.schedule import StepPlan


def loss_scale(micro_steps: int) -> float:
    """training_loss's grad_scale, the upstream gradient of every token's loss: each of a step's
    micro-steps contributes 1 / micro_steps (also the fp8 lm head's gradient scale factor,
    trainer/build.prepare_model)."""
    return 1.0 / micro_steps


class GradHandoff:
    """Sets p.grad after a backward as loss.backward() plus the plan's Adam cadence would.

    ANVIL (micro_steps == 1): p.grad = the backward's own buffer (graph memory under graphs,
    overwritten by the next replay of that key: the optimizer consumes it in this step).
    Otherwise p.grad = a persistent accumulator owned here (address-stable, censused): copied on
    the first backward of its accumulation window (Adam: micro-step 0 of a plan.adam_first step;
    ANVIL: micro-step 0 of every step), added on the others.
    """

    __slots__ = ("anvil_params", "adam_first", "micro_steps", "accumulators")

    def __init__(self, param_cfgs: dict[nn.Parameter, Any], plans: Sequence[StepPlan],
                 micro_steps: int):
        """`plans`: the schedule's plan of every step the runner serves, indexed by step;
        `micro_steps`: backwards per step (RunSpec.micro_steps)."""
        if micro_steps < 1:
            raise ValueError(f"micro_steps={micro_steps} must be >= 1")
        self.anvil_params = {p for p, cfg in param_cfgs.items() if cfg.optim == "anvil"}
        self.adam_first = tuple(plan.adam_first for plan in plans)  # indexed by step
        self.micro_steps = micro_steps
        self.accumulators: dict[nn.Parameter, Tensor] = {}

    @property
    def loss_scale(self) -> float:
        """training_loss's grad_scale (the module function loss_scale)."""
        return loss_scale(self.micro_steps)

    def copies_adam(self, step: int, micro_step: int) -> bool:
        """Whether this backward's Adam gradients are copied into the accumulators (opening the
        window) rather than added: micro-step 0 of a plan.adam_first step."""
        if not 0 <= micro_step < self.micro_steps:
            raise StepGraphError(f"step {step}: micro_step {micro_step} outside "
                                 f"[0, micro_steps={self.micro_steps})")
        if not 0 <= step < len(self.adam_first):
            raise StepGraphError(f"step {step}: outside the {len(self.adam_first)} planned steps")
        return micro_step == 0 and self.adam_first[step]

    def hand_over(self, step: int, micro_step: int,
                  grads: Iterable[tuple[nn.Parameter, Tensor]]) -> None:
        adam_first = self.copies_adam(step, micro_step)
        copies, adds = [], []
        for p, grad in grads:
            anvil = p in self.anvil_params
            if anvil and self.micro_steps == 1:
                p.grad = grad
                continue
            acc = self.accumulators.get(p)
            if acc is None:
                acc = self.accumulators[p] = torch.empty_like(grad)
            first = micro_step == 0 if anvil else adam_first
            (copies if first else adds).append((acc, grad))
            p.grad = acc
        for accs, grads in _by_dtype(copies):
            torch._foreach_copy_(accs, grads)
        for accs, grads in _by_dtype(adds):
            torch._foreach_add_(accs, grads)


def _by_dtype(pairs: list[tuple[Tensor, Tensor]]) -> list[tuple[list[Tensor], list[Tensor]]]:
    """(accumulators, gradients) grouped by (device, dtype): a foreach call over mixed dtypes takes
    torch's per-tensor slow path (one kernel per tensor: ~40 small float32 adds per step beside
    the bf16 ones, measured on the H200); per group it is one multi-tensor kernel."""
    groups: dict[tuple, tuple[list[Tensor], list[Tensor]]] = {}
    for acc, grad in pairs:
        accs, grads = groups.setdefault((acc.device, acc.dtype, grad.dtype), ([], []))
        accs.append(acc)
        grads.append(grad)
    return list(groups.values())


def check_ngram_grad(key: StepGraphKey, ngram_grad: Tensor | None) -> None:
    """A captured key's n-gram sink gradient must be [2T, D] (the forward added grad_sink(T))."""
    if ngram_grad is None or ngram_grad.dim() != 2 or ngram_grad.shape[0] != 2 * key.tokens:
        shape = None if ngram_grad is None else tuple(ngram_grad.shape)
        raise StepGraphError(f"key {key}: n-gram sink gradient has shape {shape}, expected "
                             f"[{2 * key.tokens}, D]; the forward must add grad_sink(T)")
