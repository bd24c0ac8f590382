"""Training schedule: stages -> the per-step values the trainer, the model and the optimizer read.

What it replaces: the schedule helpers spread over the speedrun's train_gpt.py (`:1880-2007`:
stage table, `get_lr`, `get_muon_momentum`, the per-step MTP weight tensors, the YaRN/window
switches), which mix Python values, device tensors and global state. Here one pure-Python object
answers "what does step s look like" and nothing else: no torch import, no device, no globals, so
the whole schedule is unit-tested on CPU in milliseconds and the capture plan
(perf/cuda_graphs/capture_plan.py) derives its graph keys from the same answers the timed run uses.

Why it matters for speed: the step graphs are captured per StepGraphKey, i.e. per distinct set of
shapes and Python values the compiled model specializes on. Within a stage only tensor *values*
change (MTP weights, prefix weight, lr, momentum), which the trainer copies into static buffers, so
the speedrun has exactly 4 training keys (modded_nanogpt_facts.md section 3).

What must stay stable: nothing here owns memory. The numbers are the contract: stage boundaries
[0, 423), [423, 847), [847, 1270), [1270, 1285); lr 1.52 at 508, 0.912 at 846, 1.027 at 847, 0.152 at
1269, 0.15 in the extension; momentum 0.85 -> 0.95 over steps 0-300, back to 0.85 over the last 50.

The plan is the one source of every cadence of the training step; nothing else derives one
from the step number. `StepPlan` says, for step s: the ANVIL momentum; `adam_step` (Adam updates
after s, on the gradients summed since the last Adam step); `adam_first` (s opens such an
accumulation window: the step handoff copies its first micro-step's gradient into the Adam
accumulator instead of adding); `ngram_event` (the n-gram table applies its held gradients after
s); `nothing_held` (after s neither an Adam gradient nor an n-gram gradient is held, so a
checkpoint taken there is exact). Their consumers, each reading the plan: the optimizer
(trainer/step.py passes plan.momentum and plan.adam_step to AnvilAndAdam.step), GradHandoff
(perf/cuda_graphs/grad_handoff.py, built with the plans), the warmup visit plan's cadence span
(perf/cuda_graphs/capture_plan.py), the n-gram update events (trainer/step.py) and the store's
held-gradient bound (`ngram_cycle` x the run's micro-steps, perf/ngram_store.py), and checkpoint
alignment (trainer/checkpoint.aligned; `checkpoint_period` validates --save-every).
tests/test_cadence.py checks every consumer against the plan over the whole speedrun schedule.

Call order: train.py builds `Schedule(cfg)` once; capture_plan.step_keys() and
warmup_visit_plan() read it before warmup; every step (warmup and timed) calls `plan(step)` and
turns the StepPlan into a ForwardScheduleConfig (tensors) and optimizer hyperparameters.

Provenance: modded-nanogpt HEAD `train_gpt.py:1880-2007` (facts sections 3 and 5): stage table,
cooldown_frac 0.6 from int(1270*0.4)=508, final lr multiplier 0.15, Muon momentum warmup/cooldown,
Adam on odd steps (`:2104-2106`), YaRN applied where ws_long changes (423, 847, 1270).
Deviations: the momentum cooldown counts from the last step of the whole run including the
extension (the facts' "from step 1235"); the n-gram update cadence (`ngram_cycle`) is this
package's (perf/ngram_store.py), with a forced update event on the last step so no gradient is
left held.
"""

import math
from dataclasses import dataclass

from track_1_short.constants import MAX_CYCLE_STEPS



from track_1_short.model.tokens import BLOCK_TOKENS


@dataclass(slots=True, kw_only=True)
class StageConfig:
    """One stage of the schedule: everything the compiled model specializes on is constant here."""

    name: str
    num_steps: int
    tokens_per_rank: int  # T: tokens per rank per micro-step
    ws_short: int  # short sliding window, tokens (multiple of BLOCK_TOKENS)
    ws_long: int  # long sliding window, tokens (multiple of BLOCK_TOKENS); YaRN follows it
    max_seq_len: int  # documents are truncated to this many tokens
    # fixed length of Batch.cum_seqlens for this stage (padded with zero-length documents); None:
    # sized from the data at start (trainer/preflight.py: the most documents any micro-batch of
    # the stage can hold in the run's shards), so it is an int in every schedule a run builds
    cu_seqlens_rows: int | None = None
    mtp_weights_start: tuple[float, ...]  # multi-token-prediction weights at the stage's first step
    mtp_weights_end: tuple[float, ...]  # ... and (linearly interpolated) after its last step
    prefix_weight_start: float
    prefix_weight_end: float
    lr_mul: float  # multiplier of the base lr before the cooldown blends it to final_lr_mul
    extension: bool = False  # an extension stage runs after the scheduled steps at final_lr_mul

    def __post_init__(self):
        if self.num_steps <= 0:
            raise ValueError(f"stage {self.name}: num_steps must be > 0, got {self.num_steps}")
        if self.tokens_per_rank <= 0:
            raise ValueError(f"stage {self.name}: tokens_per_rank must be > 0")
        for name in ("ws_short", "ws_long"):
            value = getattr(self, name)
            if value <= 0 or value % BLOCK_TOKENS:
                raise ValueError(f"stage {self.name}: {name}={value} must be a positive multiple "
                                 f"of {BLOCK_TOKENS} (attention block size)")
        if self.ws_short > self.ws_long:
            raise ValueError(f"stage {self.name}: ws_short={self.ws_short} > ws_long={self.ws_long}")
        if self.max_seq_len <= 0 or self.max_seq_len > self.tokens_per_rank:
            raise ValueError(f"stage {self.name}: max_seq_len={self.max_seq_len} must be in "
                             f"(0, tokens_per_rank={self.tokens_per_rank}]")
        if self.cu_seqlens_rows is not None and self.cu_seqlens_rows < 2:
            raise ValueError(f"stage {self.name}: cu_seqlens_rows must be >= 2 (one document)")
        if not self.mtp_weights_start or len(self.mtp_weights_start) != len(self.mtp_weights_end):
            raise ValueError(f"stage {self.name}: mtp_weights_start and mtp_weights_end must be "
                             f"non-empty and the same length ({len(self.mtp_weights_start)} != "
                             f"{len(self.mtp_weights_end)})")
        if self.lr_mul <= 0:
            raise ValueError(f"stage {self.name}: lr_mul must be > 0")


SPEEDRUN_STAGES = (
    StageConfig(name="A", num_steps=423, tokens_per_rank=16384, ws_short=128, ws_long=384,
                max_seq_len=896, mtp_weights_start=(1.0, 0.5, 0.25),
                mtp_weights_end=(1.0, 0.5, 0.0), prefix_weight_start=0.25, prefix_weight_end=0.25,
                lr_mul=1.0),
    StageConfig(name="B", num_steps=424, tokens_per_rank=32768, ws_short=384, ws_long=896,
                max_seq_len=2048, mtp_weights_start=(1.0, 0.5),
                mtp_weights_end=(1.0, 0.0), prefix_weight_start=0.25, prefix_weight_end=0.0,
                lr_mul=1.52),
    StageConfig(name="C", num_steps=423, tokens_per_rank=49152, ws_short=640, ws_long=1408,
                max_seq_len=2048, mtp_weights_start=(1.0,),
                mtp_weights_end=(1.0,), prefix_weight_start=0.0, prefix_weight_end=0.0, lr_mul=1.73),
    # lr_mul is unused in an extension stage (its lr is final_lr_mul); 1.0 keeps validation simple.
    StageConfig(name="D", num_steps=15, tokens_per_rank=49152, ws_short=768, ws_long=1664,
                max_seq_len=2048, mtp_weights_start=(1.0,),
                mtp_weights_end=(1.0,), prefix_weight_start=0.0, prefix_weight_end=0.0, lr_mul=1.0,
                extension=True),
)


STAGE_START_VALIDATIONS = ("trained", "next")  # ScheduleConfig.stage_start_validation


@dataclass(slots=True, kw_only=True)
class ScheduleConfig:
    stages: tuple[StageConfig, ...] = SPEEDRUN_STAGES
    cooldown_frac: float = 0.6  # last fraction of the scheduled (non-extension) steps blends lr down
    final_lr_mul: float = 0.15  # lr multiplier at the end of the cooldown and in extension stages
    momentum_min: float = 0.85
    momentum_max: float = 0.95
    momentum_warmup_steps: int = 300  # momentum_min -> momentum_max over steps [0, this]
    momentum_cooldown_steps: int = 50  # momentum_max -> momentum_min over the run's last steps
    # Adam updates after steps s with s % adam_every == adam_every - 1 (odd steps), on the gradients
    # of the adam_every steps since the last one (StepPlan.adam_step / adam_first)
    adam_every: int = 2
    ngram_cycle: int = 2  # n-gram table update event every this many steps (<= MAX_CYCLE_STEPS)
    # embed and lm_head untie after this step's update (an Adam step); None: the first odd step of
    # the third stage (facts 3; 847 in the speedrun), no untie with fewer stages. bench/step.py
    # sets it for a stage-C-only run, so its warmup captures both Adam cadences.
    untie_step: int | None = None
    val_every_steps: int = 250  # validation before steps that are multiples of this, and at the end
    final_val_ws_long: int = 2560  # long window of the final validation (ws_short: last stage's)
    # the validation before a stage's first step runs with: "trained" the windows and YaRN state
    # trained so far (ours), "next" those of the stage about to start (the record's: its
    # advance_schedule moves windows and YaRN before it validates; loss-parity runs use it so
    # both trainers measure the same thing at the stage starts)
    stage_start_validation: str = "trained"

    def __post_init__(self):
        self.stages = tuple(self.stages)
        if not self.stages:
            raise ValueError("stages must not be empty")
        seen_extension = False
        for stage in self.stages:
            if seen_extension and not stage.extension:
                raise ValueError(f"stages: extension stages must come last, but {stage.name} "
                                 f"follows one")
            seen_extension |= stage.extension
        if all(stage.extension for stage in self.stages):
            raise ValueError("stages: at least one stage must not be an extension")
        if len({stage.name for stage in self.stages}) != len(self.stages):
            raise ValueError("stages: stage names must be unique")
        if self.stage_start_validation not in STAGE_START_VALIDATIONS:
            raise ValueError(f"stage_start_validation={self.stage_start_validation!r}: one of "
                             f"{STAGE_START_VALIDATIONS}")
        if not 0.0 <= self.cooldown_frac <= 1.0:
            raise ValueError(f"cooldown_frac={self.cooldown_frac} must be in [0, 1]")
        if not 1 <= self.ngram_cycle <= MAX_CYCLE_STEPS:
            raise ValueError(f"ngram_cycle={self.ngram_cycle} must be in [1, MAX_CYCLE_STEPS="
                             f"{MAX_CYCLE_STEPS}] (the held n-gram gradients' bound)")
        if self.untie_step is not None and (self.untie_step < 0
                                            or self.untie_step % self.adam_every != self.adam_every - 1):
            raise ValueError(f"untie_step={self.untie_step} must be an Adam step (s % adam_every == "
                             f"adam_every - 1, adam_every={self.adam_every})")
        if self.adam_every < 1:
            raise ValueError(f"adam_every={self.adam_every} must be >= 1")
        if self.val_every_steps < 1:
            raise ValueError(f"val_every_steps={self.val_every_steps} must be >= 1")
        if self.final_val_ws_long <= 0 or self.final_val_ws_long % BLOCK_TOKENS:
            raise ValueError(f"final_val_ws_long={self.final_val_ws_long} must be a positive "
                             f"multiple of {BLOCK_TOKENS}")
        if not 0 <= self.momentum_min <= self.momentum_max < 1:
            raise ValueError("momentum_min/momentum_max need 0 <= min <= max < 1, got "
                             f"{self.momentum_min}, {self.momentum_max}")
        if self.momentum_warmup_steps < 0 or self.momentum_cooldown_steps < 0:
            raise ValueError("momentum_warmup_steps and momentum_cooldown_steps must be >= 0")


@dataclass(slots=True, frozen=True)
class StepPlan:
    """Everything step `step` needs from the schedule (Python values; the trainer makes tensors)."""

    step: int
    stage_index: int
    stage: str
    tokens_per_rank: int
    ws_short: int
    ws_long: int
    max_seq_len: int
    cu_seqlens_rows: int
    mtp_weights: tuple[float, ...]
    prefix_weight: float
    lr_mul: float
    momentum: float  # ANVIL momentum of this step's update
    adam_step: bool  # Adam updates after this step, on the gradients summed since the last one
    adam_first: bool  # this step opens an Adam accumulation window (the previous one was adam_step)
    ngram_event: bool  # the n-gram table applies its held gradients after this step
    nothing_held: bool  # adam_step and ngram_event: after this step a checkpoint is exact
    validate: bool  # a validation pass runs before this step trains (the final one after the last)


@dataclass(slots=True, frozen=True)
class Transition:
    """The first step of a stage after the first one."""

    step: int
    old_stage: str
    new_stage: str


def _lerp(start: float, end: float, t: float) -> float:
    return start + (end - start) * t


class Schedule:
    """Pure function of the step: `plan(step)` for every step in [0, num_steps)."""

    def __init__(self, cfg: ScheduleConfig):
        self.cfg = cfg
        self.stage_starts: tuple[int, ...] = tuple(
            sum(s.num_steps for s in cfg.stages[:i]) for i in range(len(cfg.stages)))
        self.num_steps = sum(s.num_steps for s in cfg.stages)
        self.num_scheduled_steps = sum(s.num_steps for s in cfg.stages if not s.extension)
        self.cooldown_start = int(self.num_scheduled_steps * (1 - cfg.cooldown_frac))

    def stage_index(self, step: int) -> int:
        if not 0 <= step < self.num_steps:
            raise ValueError(f"step {step} outside the schedule [0, {self.num_steps})")
        index = 0
        while index + 1 < len(self.stage_starts) and self.stage_starts[index + 1] <= step:
            index += 1
        return index

    def lr_mul(self, step: int) -> float:
        stage = self.cfg.stages[self.stage_index(step)]
        if stage.extension:
            return self.cfg.final_lr_mul
        span = self.num_scheduled_steps - self.cooldown_start
        t = 1.0 if span <= 0 else min(max((step - self.cooldown_start) / span, 0.0), 1.0)
        return _lerp(stage.lr_mul, self.cfg.final_lr_mul, t)

    def momentum(self, step: int) -> float:
        cfg = self.cfg
        if step < cfg.momentum_warmup_steps:
            return _lerp(cfg.momentum_min, cfg.momentum_max, step / cfg.momentum_warmup_steps)
        cooldown_start = self.num_steps - cfg.momentum_cooldown_steps
        if cfg.momentum_cooldown_steps and step > cooldown_start:
            t = (step - cooldown_start) / cfg.momentum_cooldown_steps
            return _lerp(cfg.momentum_max, cfg.momentum_min, t)
        return cfg.momentum_max

    def plan(self, step: int) -> StepPlan:
        index = self.stage_index(step)
        stage = self.cfg.stages[index]
        start = self.stage_starts[index]
        t = (step - start) / stage.num_steps
        last = step == self.num_steps - 1
        every, cycle = self.cfg.adam_every, self.cfg.ngram_cycle
        adam_step = step % every == every - 1
        # the last step forces an event, so no n-gram gradient is left held at the end
        ngram_event = last or step % cycle == cycle - 1
        return StepPlan(
            step=step, stage_index=index, stage=stage.name,
            tokens_per_rank=stage.tokens_per_rank, ws_short=stage.ws_short, ws_long=stage.ws_long,
            max_seq_len=stage.max_seq_len, cu_seqlens_rows=stage.cu_seqlens_rows,
            mtp_weights=tuple(_lerp(a, b, t) for a, b in
                              zip(stage.mtp_weights_start, stage.mtp_weights_end)),
            prefix_weight=_lerp(stage.prefix_weight_start, stage.prefix_weight_end, t),
            lr_mul=self.lr_mul(step), momentum=self.momentum(step),
            adam_step=adam_step, adam_first=step % every == 0, ngram_event=ngram_event,
            nothing_held=adam_step and ngram_event,
            validate=step % self.cfg.val_every_steps == 0,
        )

    def ngram_steps_held(self, step: int) -> int:
        """Steps whose n-gram gradients are held when `step` starts, in a run that trains every
        step in order: those since the plan's last update event before it (the store then holds
        this many times the micro-steps; benches and tests that drive a runner without a store)."""
        held = 0
        while step - held > 0 and not self.plan(step - held - 1).ngram_event:
            held += 1
        return held

    @property
    def untie_step(self) -> int | None:
        """Embed and lm_head untie after this step's update: ScheduleConfig.untie_step, else
        facts 3: the start of the third stage, made odd so it is an Adam step (847 in the
        speedrun); None with fewer than 3 stages."""
        if self.cfg.untie_step is not None:
            return self.cfg.untie_step
        return self.stage_starts[2] | 1 if len(self.stage_starts) >= 3 else None

    @property
    def checkpoint_period(self) -> int:
        """Steps between the boundaries where nothing is held (StepPlan.nothing_held: an Adam step
        that is also an n-gram event): --save-every must be a multiple of it. The forced event of
        the last step can add the run's end as one more such boundary."""
        return math.lcm(self.cfg.adam_every, self.cfg.ngram_cycle)

    def transitions(self) -> list[Transition]:
        out = []
        for index in range(1, len(self.cfg.stages)):
            old, new = self.cfg.stages[index - 1], self.cfg.stages[index]
            out.append(Transition(step=self.stage_starts[index], old_stage=old.name,
                                  new_stage=new.name))
        return out

    def final_validation_windows(self) -> tuple[int, int]:
        """(ws_short, ws_long) of the validation after the last step (768/2560 for the speedrun)."""
        return self.cfg.stages[-1].ws_short, self.cfg.final_val_ws_long


__all__ = ["BLOCK_TOKENS", "MAX_CYCLE_STEPS", "SPEEDRUN_STAGES", "Schedule", "ScheduleConfig",
           "StageConfig", "StepPlan", "Transition"]
