"""EagerStep: the eager twin of StepGraphs (`--graphs off`), the same StepRunner interface and
the same p.grad semantics (GradHandoff), running the compiled model directly, so train_step is
one piece of code for graphs on and off (step_runner.py has the call order).

What it replaces: a second copy of the training step for runs without graphs. Why it matters:
`--graphs off` is the baseline graphs are measured against (bench/step_graphs.py, the small-gpu
on/off runs), so the two must differ only in how the forward and backward launch.

What must stay stable: nothing is baked; backward() returns fresh gradients the caller owns.
baked_tensors() is empty and seal() does nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from torch import Tensor, nn

from track_1_short.perf.cuda_graphs.capture_plan import StepGraphKey
from track_1_short.perf.cuda_graphs.capture_support import StepGraphError, loss_grads
from track_1_short.perf.cuda_graphs.grad_handoff import GradHandoff
from track_1_short.perf.cuda_graphs.step_runner import check_key, training_loss

if TYPE_CHECKING:
    from track_1_short.data import Batch
    from track_1_short.model.gpt import ForwardScheduleConfig
    from track_1_short.ngram_table import NgramTable
    from track_1_short.optim.anvil import AnvilAndAdam
    from track_1_short.perf.value_embed_pull import ValueEmbedPull
    from track_1_short.schedule import StepPlan


class EagerStep:
    """The eager twin of StepGraphs (`--graphs off`): same methods, same p.grad semantics, runs the
    compiled model directly, so train_step is one piece of code for graphs on and off."""

    def __init__(self, model: nn.Module, optimizer: AnvilAndAdam, step_keys: list[StepGraphKey],
                 ngram_table: NgramTable, value_embeds: ValueEmbedPull, *,
                 plans: Sequence[StepPlan], micro_steps: int):
        self.model = model
        self.params = list(optimizer.param_cfgs)
        self.handoff = GradHandoff(optimizer.param_cfgs, plans, micro_steps)
        self.step_keys = list(step_keys)
        self.ngram_table = ngram_table
        self.value_embeds = value_embeds
        self.in_flight: tuple[int, int, Tensor, Tensor] | None = None

    def forward(self, step: int, batch: Batch, ngram_slots: Tensor, cfg: ForwardScheduleConfig, *,
                micro_step: int = 0) -> Tensor:
        """Run the loss with autograd. Returns the 0-d loss, detached (the caller owns it)."""
        check_key(step, batch, cfg, self.step_keys)
        sink = self.ngram_table.grad_sink(batch.inputs.numel())
        loss = training_loss(self.model, batch.inputs, batch.targets, batch.cum_seqlens,
                             ngram_slots, cfg, sink, self.value_embeds.grad_accum,
                             self.handoff.loss_scale)
        self.in_flight = (step, micro_step, loss, sink)
        return loss.detach()

    def backward(self) -> Tensor:
        """Gradients as the captured backward computes them; sets p.grad (GradHandoff). Returns
        the n-gram sink gradient [2T, D], a fresh tensor the caller owns."""
        if self.in_flight is None:
            raise StepGraphError("backward() without a preceding forward()")
        step, micro_step, loss, sink = self.in_flight
        self.in_flight = None
        grads = loss_grads(loss, self.params + [sink])
        self.handoff.hand_over(step, micro_step,
                               [(p, g) for p, g in zip(self.params, grads) if g is not None])
        return grads[-1]

    def seal(self) -> None:
        pass

    def baked_tensors(self) -> Iterator[tuple[str, Tensor]]:
        return iter(())

    def capture_report(self) -> list[dict]:
        return []
