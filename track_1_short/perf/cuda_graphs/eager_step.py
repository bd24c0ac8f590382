"""EagerStep: the eager twin of StepGraphs (`--graphs off`), the same StepRunner interface and
the same p.grad semantics (GradHandoff), running the compiled model directly, so train_step is
one piece of code for graphs on and off (step_runner.py has the call order).

What it replaces: a second copy of the training step for runs without graphs. Why it matters:
`--graphs off` is the baseline graphs are measured against (bench/step_graphs.py, the small-gpu
on/off runs), so the two must differ only in how the forward and backward launch.

With the n-gram rows inside the step (`ngram_store` given, one rank) it runs the same
NgramStore.pull_ before the forward and accumulate_ after the backward that StepGraphs captures.

What must stay stable: nothing is baked; backward() returns fresh gradients the caller owns.
baked_tensors() is empty and seal() does nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from track_1_short.perf.cuda_graphs.capture_plan import StepGraphKey
from track_1_short.perf.cuda_graphs.capture_support import StepGraphError, loss_grads
from track_1_short.perf.cuda_graphs.grad_handoff import GradHandoff
from track_1_short.perf.cuda_graphs.step_runner import check_key, check_rows_mode, training_loss

if TYPE_CHECKING:
    from track_1_short.data import Batch
    from track_1_short.model.gpt import ForwardScheduleConfig
    from track_1_short.ngram_table import NgramTable
    from track_1_short.optim.anvil import AnvilAndAdam
    from track_1_short.perf.ngram_store import NgramStore
    from track_1_short.perf.value_embed_pull import ValueEmbedPull
    from track_1_short.schedule import StepPlan


class EagerStep:
    """The eager twin of StepGraphs (`--graphs off`): same methods, same p.grad semantics, runs the
    compiled model directly, so train_step is one piece of code for graphs on and off."""

    def __init__(self, model: nn.Module, optimizer: AnvilAndAdam, step_keys: list[StepGraphKey],
                 ngram_table: NgramTable, value_embeds: ValueEmbedPull, *,
                 plans: Sequence[StepPlan], micro_steps: int, ngram_store: NgramStore | None = None,
                 embed_grad: Tensor | None = None):
        """As StepGraphs' (embed_grad: the token embedding's pulled-gradient buffer or None)."""
        self.model = model
        self.embed_grad = embed_grad
        self.ngram_store = ngram_store  # rows inside the step (one rank), else None
        self.params = list(optimizer.param_cfgs)
        self.handoff = GradHandoff(optimizer.param_cfgs, plans, micro_steps)
        self.step_keys = list(step_keys)
        self.ngram_table = ngram_table
        self.value_embeds = value_embeds
        self.in_flight: tuple[int, int, Tensor, Tensor, Tensor | None] | None = None

    def forward(self, step: int, batch: Batch, ngram_slots: Tensor | None, cfg: ForwardScheduleConfig,
                *, micro_step: int = 0) -> Tensor:
        """Run the loss with autograd. Returns the 0-d loss, detached (the caller owns it).
        ngram_slots None exactly with rows in the step: pulled here first (NgramStore.pull_)."""
        check_key(step, batch, cfg, self.step_keys)
        check_rows_mode(step, ngram_slots, self.ngram_store)
        ids = None
        if self.ngram_store is not None:
            ids = batch.inputs.new_empty(2 * batch.inputs.numel(), dtype=torch.int64)  # [2T]
            ngram_slots = torch.empty_like(ids)
            self.ngram_store.pull_(batch.inputs, ids, ngram_slots)
        sink = self.ngram_table.grad_sink(batch.inputs.numel())
        loss = training_loss(self.model, batch.inputs, batch.targets, batch.cum_seqlens,
                             ngram_slots, cfg, sink, self.value_embeds.grad_accum,
                             self.handoff.loss_scale, embed_grad=self.embed_grad)
        self.in_flight = (step, micro_step, loss, sink, ids)
        return loss.detach()

    def backward(self) -> Tensor | None:
        """Gradients as the captured backward computes them; sets p.grad (GradHandoff). Returns
        the n-gram sink gradient [2T, D], a fresh tensor the caller owns (None with rows in the
        step: added into the store's accumulator here, NgramStore.accumulate_)."""
        if self.in_flight is None:
            raise StepGraphError("backward() without a preceding forward()")
        step, micro_step, loss, sink, ids = self.in_flight
        self.in_flight = None
        grads = loss_grads(loss, self.params + [sink])
        self.handoff.hand_over(step, micro_step,
                               [(p, g) for p, g in zip(self.params, grads) if g is not None])
        if ids is None:
            return grads[-1]
        self.ngram_store.accumulate_(grads[-1], ids)
        return None

    def seal(self) -> None:
        pass

    def baked_tensors(self) -> Iterator[tuple[str, Tensor]]:
        return iter(())

    def capture_report(self) -> list[dict]:
        return []
