"""Gradient handoff after a backward (GradHandoff) and the n-gram gradient ring (NgramGradRing):
who owns each gradient a backward produced, and until when. Shared by StepGraphs and its eager
twin EagerStep, so p.grad means the same with graphs on and off.

Gradients (GradHandoff): the captured backward writes each gradient into its own pool buffer,
rewritten by the next replay of that key; no AccumulateGrad runs. ANVIL banks take the graph's
buffer as p.grad (their reduce-scatter reads it before the next backward); Adam parameters,
stepped every `adam_every` steps on the summed gradient, go through one persistent accumulator
per parameter: copy on the first step of the cycle, add on the others, decided from the cadence
(not from `p.grad is None`, which breaks when the optimizer keeps .grad). With grad_accum_steps > 1
(fewer than 8 GPUs) ANVIL banks get persistent accumulators as well.

The n-gram ring (NgramGradRing): the sink gradient is held by the n-gram store until its update
event, up to MAX_CYCLE_STEPS steps (cycle x micro-steps held gradients), so under graphs a
non-event micro-step's gradient is copied to a private ring slot before the next replay rewrites
the graph's buffer. Flat slots of [2 * max_step_tokens * D], allocated at the first capture in the
sink gradient's dtype (D is the store's row width, read from that gradient); each key views its
own [2T, D] prefix.

What must stay address-stable: the accumulators and the ring slots (StepGraphs.baked_tensors()
lists both; the census compares them around the post-warmup reset).

Provenance: record #360 `_CGraphRunner` (`_acc`, `_sink_flat` ring), via the seed.
Legend: T tokens of a key, D n-gram row width.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from track_1_short.perf.cuda_graphs.capture_plan import StepGraphKey
from track_1_short.perf.cuda_graphs.capture_support import StepGraphError


class GradHandoff:
    """Sets p.grad after a backward as loss.backward() plus the optimizer's cadence would.

    ANVIL (grad_accum_steps == 1): p.grad = the backward's own buffer (graph memory under graphs,
    overwritten by the next replay of that key: the optimizer consumes it in this step).
    Otherwise p.grad = a persistent accumulator owned here (address-stable, censused): copied on
    the first backward of its accumulation cycle, added on the others.
    """

    __slots__ = ("anvil_params", "adam_every", "grad_accum_steps", "accumulators")

    def __init__(self, param_cfgs: dict[nn.Parameter, Any], adam_every: int, grad_accum_steps: int):
        if adam_every < 1 or grad_accum_steps < 1:
            raise ValueError(f"adam_every={adam_every} and grad_accum_steps={grad_accum_steps} "
                             f"must be >= 1")
        self.anvil_params = {p for p, cfg in param_cfgs.items() if cfg.optim == "anvil"}
        self.adam_every = adam_every
        self.grad_accum_steps = grad_accum_steps
        self.accumulators: dict[nn.Parameter, Tensor] = {}

    @property
    def loss_scale(self) -> float:
        """training_loss's grad_scale: each micro-step contributes 1 / grad_accum_steps."""
        return 1.0 / self.grad_accum_steps

    def hand_over(self, step: int, micro_step: int,
                  grads: Iterable[tuple[nn.Parameter, Tensor]]) -> None:
        if not 0 <= micro_step < self.grad_accum_steps:
            raise StepGraphError(f"step {step}: micro_step {micro_step} outside "
                                 f"[0, grad_accum_steps={self.grad_accum_steps})")
        adam_first = micro_step == 0 and step % self.adam_every == 0
        copies, adds = [], []
        for p, grad in grads:
            anvil = p in self.anvil_params
            if anvil and self.grad_accum_steps == 1:
                p.grad = grad
                continue
            acc = self.accumulators.get(p)
            if acc is None:
                acc = self.accumulators[p] = torch.empty_like(grad)
            first = micro_step == 0 if anvil else adam_first
            (copies if first else adds).append((acc, grad))
            p.grad = acc
        if copies:
            torch._foreach_copy_([acc for acc, _ in copies], [g for _, g in copies])
        if adds:
            torch._foreach_add_([acc for acc, _ in adds], [g for _, g in adds])


def check_ngram_pending(pending: int, ring_slots: int) -> None:
    if not 0 <= pending < ring_slots:
        raise StepGraphError(f"{pending} n-gram gradients already held, ring has {ring_slots} "
                             f"slots (cycle x micro-steps): an n-gram update event was missed or "
                             f"the cadence exceeds MAX_CYCLE_STEPS")


class NgramGradRing:
    """Ring slots for the n-gram sink gradients a store holds past the next backward replay."""

    __slots__ = ("num_slots", "max_step_tokens", "slots")

    def __init__(self, num_slots: int, max_step_tokens: int):
        self.num_slots = num_slots  # most gradients held at once (ngram_cycle x micro-steps)
        self.max_step_tokens = max_step_tokens
        self.slots: list[Tensor] = []  # each [2 * max_step_tokens * D], allocated by adopt()

    def adopt(self, key: StepGraphKey, ngram_grad: Tensor | None) -> None:
        """Check a captured key's sink gradient [2T, D] and size the ring from the first one (D is
        the store's row width, read from the sink the lookup allocated, so tiny configs work)."""
        if ngram_grad is None or ngram_grad.dim() != 2 or ngram_grad.shape[0] != 2 * key.tokens:
            shape = None if ngram_grad is None else tuple(ngram_grad.shape)
            raise StepGraphError(f"key {key}: n-gram sink gradient has shape {shape}, expected "
                                 f"[{2 * key.tokens}, D]; the forward must add grad_sink(T)")
        if self.slots and self.slots[0].dtype != ngram_grad.dtype:
            raise StepGraphError(f"key {key}: n-gram sink gradient dtype {ngram_grad.dtype} != "
                                 f"ring dtype {self.slots[0].dtype}")
        if not self.slots:
            numel = 2 * self.max_step_tokens * ngram_grad.shape[1]
            self.slots = [torch.empty(numel, dtype=ngram_grad.dtype, device=ngram_grad.device)
                          for _ in range(self.num_slots)]

    def hold(self, ngram_grad: Tensor, pending: int, event_this_step: bool) -> Tensor:
        """The graph's own buffer if this step's update event consumes it before the next replay,
        else a copy in ring slot `pending` (owned here, rewritten when slot `pending` is used again
        in a later cycle)."""
        if event_this_step:
            return ngram_grad
        check_ngram_pending(pending, len(self.slots))
        slot = self.slots[pending][:ngram_grad.numel()].view_as(ngram_grad)
        slot.copy_(ngram_grad)
        return slot
