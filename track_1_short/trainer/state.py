"""The trainer's state, split by concern and lifecycle instead of one bag of fields.

What it replaces: a 28-field `Run` dataclass (four fields typed `object`) that every phase
function and the checkpoint code took whole and reached into (`run.cfg.optim.adam_every`,
`run.cfg.schedule.ngram_cycle`), so no function said what it reads or writes. Every cadence is
now read from `RunSpec.plans` (schedule.StepPlan), the run constant micro-step count from
`RunSpec.micro_steps`.

The four parts, in the order they come to exist (trainer/lifecycle.py):
  RunSpec    what this run is: config, ranks, schedule and its per-step plans, the run dir. Built
             once from the config (build.make_spec), frozen; read by everything, written by nothing.
  StepParts  what a step runs: the model and its compiled forms, the optimizer, the step runner
             (graphs or eager), the n-gram store and its row prefetch. Built once by build.prepare_model; the
             step graphs bake their tensors, so nothing rebinds them afterwards.
  Progress   where the run stands: steps done, the train clock, the val curve, the loader, the
             last checkpoint. Advanced by the timed run; saved and restored by checkpoints.
  RunLog     what the run reports: metrics, the step timer, host syncs, compile counts, the profile.
`Run` holds the four (plus the validation tokens and the graceful-stop handle) for the phase
functions that orchestrate all of them (warmup, timed run, finish); leaf functions (train_step,
evaluate, checkpoints) take only the parts they use.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
from torch import Tensor

from track_1_short.config import RunConfig
from track_1_short.distributed import DistributedContext
from track_1_short.report import MetricsLog
from track_1_short.schedule import Schedule, StepPlan
from track_1_short.trainer.timing import StepTimer, SyncCounter

if TYPE_CHECKING:
    from track_1_short.model.gpt import GPT, ForwardScheduleConfig
    from track_1_short.perf.cuda_graphs.step_runner import StepRunner
    from track_1_short.perf.ngram_store import NgramStore
    from track_1_short.perf.row_prefetch import LookaheadLoader, RowPrefetch
    from track_1_short.trainer.stop import GracefulStop


class Optimizer(Protocol):
    """What the trainer calls on its optimizer: perf/cuda_graphs/optimizer_graphs.py's
    OptimizerGraphs or EagerOptimizer around AnvilAndAdam (or the AdamW baseline)."""

    tied: object | None  # the tied (embed, lm_head) pair while tied, else None

    def step(self, step: int, lr_scale: float, momentum: float, adam_step: bool) -> None: ...
    def untie_embed_head(self) -> None: ...
    def warmup_visits(self, visits) -> list[int]: ...
    def seal(self) -> None: ...
    def baked_tensors(self): ...
    def capture_report(self) -> list[dict]: ...
    def reset(self) -> None: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


def micro_steps_per_rank(slices_per_step: int, world_size: int) -> int:
    """Micro-steps (slices) per rank per step: the global batch's slices over the ranks. The one
    formula of this run constant (RunSpec.micro_steps; the resume check compares a checkpoint's)."""
    if world_size < 1 or slices_per_step % world_size:
        raise ValueError(f"world size {world_size} must divide slices_per_step {slices_per_step} "
                         f"(use 1, 2, 4 or 8 GPUs, or set --micro-steps)")
    return slices_per_step // world_size


@dataclass(slots=True, frozen=True)
class RunSpec:
    """What this run is (see the module docstring); frozen once built."""

    cfg: RunConfig
    ctx: DistributedContext
    schedule: Schedule
    num_steps: int  # the schedule's, or --max-steps
    plans: tuple[StepPlan, ...]  # schedule.plan(step) of every step, made once: every cadence
    fwd_cfgs: tuple[ForwardScheduleConfig, ...]  # per step, tensors made once on the device
    untie_step: int | None  # embed / lm_head untie after this step's update (None: never)
    run_dir: Path

    def __post_init__(self):
        # the world size must divide the global batch (ValueError naming both otherwise)
        micro_steps_per_rank(self.cfg.data.slices_per_step, self.ctx.world_size)

    @property
    def micro_steps(self) -> int:
        """Per rank per step (micro_steps_per_rank); given at construction to everything bounded
        by it: GradHandoff (the step runner) and the n-gram store's held bound."""
        return micro_steps_per_rank(self.cfg.data.slices_per_step, self.ctx.world_size)

    @property
    def checkpoint_period(self) -> int:
        return self.schedule.checkpoint_period


@dataclass(slots=True)
class StepParts:
    """What a step runs (see the module docstring); built once, never rebound."""

    model: GPT
    forward_fn: Callable  # the compiled model (or the model itself with --no-compile)
    eval_fn: Callable  # the compiled model.eval_ce (or itself)
    optimizer: Optimizer
    runner: StepRunner
    ngram: NgramStore  # the n-gram table (this rank's rows), held gradients, update events
    prefetch: RowPrefetch
    prefix_table: Tensor  # int64 [V], installed into the model before the timed run


@dataclass(slots=True)
class Progress:
    """Where the run stands (see the module docstring)."""

    steps_done: int = 0
    train_time_s: float = 0.0  # the run's clock, including a resumed checkpoint's time
    resumed_train_time_s: float = 0.0  # train_time_s when this process's timed run started
    val_curve: list[dict] = field(default_factory=list)
    last_saved_step: int | None = None  # steps_done of this run dir's newest checkpoint by this run
    loader: LookaheadLoader | None = None


@dataclass(slots=True)
class RunLog:
    """What the run reports (see the module docstring)."""

    metrics: MetricsLog
    timer: StepTimer
    syncs: SyncCounter  # host syncs per timed step (CUDA)
    started: float = field(default_factory=time.perf_counter)  # process wall clock at the start
    warmup_s: float = 0.0
    profile: dict | None = None  # --profile-steps: the profiled window's kernel statistics
    # dynamo graphs compiled per phase ("warmup", "timed": must stay 0) and the compile cache's log
    compiles: dict[str, int] = field(default_factory=dict)
    compile_cache: dict = field(default_factory=dict)


@dataclass(slots=True)
class Run:
    """One run's parts for the orchestrating phases (see the module docstring)."""

    spec: RunSpec
    parts: StepParts
    progress: Progress
    log: RunLog
    val_tokens: np.ndarray  # uint16 [N], at most --val-tokens
    stop: GracefulStop
