"""The step runner's interface and what its two implementations share: the step loss, the live key
and its check against the schedule.

A step runner runs one micro-step's forward and backward for train_step. Two implementations,
one interface (`StepRunner`), so train_step is one piece of code for graphs on and off:
    StepGraphs  (step_graphs.py)  CUDA-graph replays of one captured pair per StepGraphKey
    EagerStep   (eager_step.py)   the compiled model run directly (`--graphs off`)
Both call `training_loss`, the single definition of the step loss (capture, warm iterations,
self-check and the eager twin), and `check_key` before every forward.

Call order per micro-step (train_step, warmup and timed alike):
    loss = runner.forward(step, batch, ngram_slots, cfg, micro_step=m)
    <row_prefetch id exchange for the next micro-batch>
    ngram_grad = runner.backward()                                   # sets p.grad
    ngram.hold(ngram_grad, ids)                                      # read before the next replay
With the n-gram rows inside the step (a runner built with the NgramStore: one rank), ngram_slots
and the returned gradient are None: the runner pulls the rows at the head of its forward and adds
the gradient into the store at the tail of its backward (NgramStore.pull_ / accumulate_), and
ngram.hold(None, None) only counts it.
    optimizer phases (read p.grad before the next backward)
After warmup: post-warmup reset, census of runner.baked_tensors(), runner.seal().
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from torch import Tensor, nn

from track_1_short.perf.cuda_graphs.capture_plan import StepGraphKey
from track_1_short.perf.cuda_graphs.capture_support import StepGraphError

if TYPE_CHECKING:
    from track_1_short.data import Batch
    from track_1_short.model.gpt import ForwardScheduleConfig


@runtime_checkable
class StepRunner(Protocol):
    """What train_step, the census and the run report call on a step runner."""

    def forward(self, step: int, batch: Batch, ngram_slots: Tensor | None, cfg: ForwardScheduleConfig,
                *, micro_step: int = 0) -> Tensor:
        """The micro-step's 0-d loss (StepGraphs: graph memory, overwritten by the next replay).
        ngram_slots None: the runner pulls the rows (rows in the step)."""

    def backward(self) -> Tensor | None:
        """Gradients of the last forward; sets p.grad. Returns the n-gram sink gradient [2T, D]
        (None with rows in the step: already added into the store's accumulator)."""

    def seal(self) -> None:
        """After warmup: from here on a step without a checked capture is fatal."""

    def baked_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """(role, tensor) of every tensor baked beyond the model's parameters and buffers."""

    def capture_report(self) -> list[dict]:
        """Per-key capture and replay statistics (empty without graphs)."""


def live_key(batch: Batch, cfg: ForwardScheduleConfig) -> StepGraphKey:
    return StepGraphKey(
        tokens=batch.inputs.numel(),
        cu_seqlens_rows=batch.cum_seqlens.numel(),
        mtp_targets=cfg.mtp_weights.numel(),
        ws_short=cfg.ws_short,
        ws_long=cfg.ws_long,
        max_seq_len=cfg.train_max_seq_len,
    )


def check_key(step: int, batch: Batch, cfg: ForwardScheduleConfig,
              step_keys: list[StepGraphKey]) -> StepGraphKey:
    """The live key, which must be the schedule's key of `step`: a replay cannot re-run dynamo's
    guards, and a new shape would mean a new graph (or, eagerly, a recompile)."""
    if not 0 <= step < len(step_keys):
        raise StepGraphError(f"step {step}: outside the planned training steps [0, {len(step_keys)})")
    key = live_key(batch, cfg)
    if key != step_keys[step]:
        raise StepGraphError(f"step {step}: live key {key} != schedule key {step_keys[step]}; the "
                             f"batch or forward config does not match the schedule")
    return key


def check_rows_mode(step: int, ngram_slots: Tensor | None, ngram_store: object | None) -> None:
    """Slots come from the caller exactly when the runner does not pull the rows itself."""
    if (ngram_slots is None) != (ngram_store is not None):
        have = "no n-gram slots" if ngram_slots is None else "n-gram slots"
        raise StepGraphError(f"step {step}: forward() got {have}, but the runner was built "
                             f"{'with' if ngram_store is not None else 'without'} the rows inside "
                             f"the step (TrainConfig.ngram_rows_in_step, RowPrefetch(rows_in_step))")


def training_loss(model: nn.Module, inputs: Tensor, targets: Tensor, cum_seqlens: Tensor,
                  ngram_slots: Tensor, cfg: ForwardScheduleConfig, ngram_sink: Tensor,
                  value_embed_grad: Tensor, grad_scale: float = 1.0,
                  embed_grad: Tensor | None = None) -> Tensor:
    """THE step loss (0-d): the single definition run by the capture, the warm iterations, the
    self-check and the eager twin. grad_scale = 1 / micro_steps (a constant of the run): with
    the optimizer's AVG over ranks, every world size then sees the mean over the step's slices.
    embed_grad: the token embedding's pulled-gradient buffer (TrainConfig.embed_grad "pull"), or
    None for its dense .grad."""
    return model(inputs, targets, cum_seqlens, ngram_slots, cfg, ngram_sink=ngram_sink,
                 value_embed_grad=value_embed_grad, embed_grad=embed_grad).sum() * grad_scale
