"""The trainer: build, compile, warmup + capture, in-place reset, census, seal, timed run, report.

What it replaces: modded-nanogpt's 2,400-line train_gpt.py main section, where the micro-step is
written twice (warmup and timed) and the process group starts at import. Here `main()` reads as
its phases, one `train_step` serves warmup and timed steps with graphs on or off (the step runner
is StepGraphs or its eager twin), and every component is applied from outside the model.

Timing (facts section 5): the clock covers data, forward, backward and optimizer, starts after a
synchronize once the reset and seal are done, and stops (synchronized) around every validation.
Per-step milliseconds come from CUDA events recorded at step boundaries (read after the run, so
the host never waits on the device for them).

Call order per step (train_step): window change (YaRN, at a stage's first step) -> per micro-step:
loader batch -> n-gram slots -> runner.forward -> runner.backward -> hold the n-gram gradient ->
optimizer.step (ANVIL every step, Adam every 2nd) -> n-gram update event.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor
from tqdm import tqdm

from track_1_short import config as config_mod
from track_1_short import report
from track_1_short.config import RunConfig
from track_1_short.data import (DataError, SliceShape, load_val_tokens, make_train_loader,
                                num_val_slices, val_batches)
from track_1_short.distributed import (DistributedContext, destroy_distributed, init_distributed,
                                       is_comm_failure, lost_ranks)
from track_1_short.model.gpt import GPT, ForwardScheduleConfig
from track_1_short.model.loss import build_prefix_table
from track_1_short.perf.profiling import StepProfiler
from track_1_short.optim.adamw_baseline import AdamWBaseline
from track_1_short.optim.anvil import AnvilAndAdam
from track_1_short.optim.anvil_config import build_param_cfgs
from track_1_short.perf import compile_cache
from track_1_short.perf.compile_cache import CompileCacheError
from track_1_short.perf.cuda_graphs import baked_addresses
from track_1_short.perf.cuda_graphs.capture_plan import describe_plan, step_keys, warmup_visit_plan
from track_1_short.perf.cuda_graphs.step_graphs import make_step_runner
from track_1_short.perf.ngram_store import NgramStore
from track_1_short.perf.row_prefetch import LookaheadLoader, RowPrefetch
from track_1_short.schedule import Schedule, StepPlan
from track_1_short.tokenizer import mergeable_ranks
from track_1_short.trainer import checkpoint
from track_1_short.trainer.checkpoint import CheckpointError, CheckpointInfo
from track_1_short.trainer.preflight import PreflightError, check_device, preflight
from track_1_short.trainer.run_dir import RunDir, RunDirError, claim_run_dir, truncate_metrics
from track_1_short.trainer.snapshot import restore_state, snapshot_state
from track_1_short.trainer.stop import GracefulStop

BF16_PARAMS = ("embed.weight", "lm_head", "qk_bank", "vo_bank", "mlp_bank", "value_embeds.weight")


@dataclass(slots=True)
class Run:
    """Everything main() builds; train_step and the phases read it."""

    cfg: RunConfig
    ctx: DistributedContext
    schedule: Schedule
    num_steps: int
    model: GPT
    forward_fn: object  # compiled model (or the model itself when --no-compile)
    eval_fn: object
    optimizer: object  # AnvilAndAdam or AdamWBaseline
    runner: object  # StepGraphs or EagerStep
    micro_steps: int
    plans: list[StepPlan]  # schedule.plan(step) of every step, made once
    fwd_cfgs: list[ForwardScheduleConfig]
    val_tokens: object
    metrics: report.MetricsLog
    run_dir: Path
    prefix_table: Tensor
    ngram: NgramStore  # the n-gram table (this rank's rows), held gradients, update events
    prefetch: RowPrefetch
    untie_step: int | None  # embed / lm_head untie after this step's update (None: never)
    loader: LookaheadLoader | None = None
    train_time_s: float = 0.0  # the run's clock, including a resumed checkpoint's time
    resumed_train_time_s: float = 0.0  # train_time_s when this process's timed run started
    profile: dict | None = None  # --profile-steps: the profiled window's kernel statistics
    timer: "StepTimer" = None
    val_curve: list[dict] = field(default_factory=list)
    warmup_s: float = 0.0
    started: float = field(default_factory=time.perf_counter)  # process wall clock: build() start
    # dynamo graphs compiled per phase ("warmup", "timed": must stay 0) and the compile cache's log
    compiles: dict[str, int] = field(default_factory=dict)
    compile_cache: dict = field(default_factory=dict)
    steps_done: int = 0  # steps trained so far (the timed run's position)
    last_saved_step: int | None = None  # steps_done of this run dir's newest checkpoint by this run
    stop: GracefulStop | None = None  # SIGTERM / SIGINT: stop at the next checkpoint boundary


class StepTimer:
    """Per-step and per-phase milliseconds without host syncs: a CUDA event at the start of each
    timed step, at the end of each of its phases (`mark`) and at its end, read once the run is
    over (host clock on CPU, where every op is synchronous anyway).

    A phase's time is the compute stream's time from the previous mark to its own: its kernels,
    plus any gap in which the stream waited for the host. Marks of a step that was not started
    are ignored (warmup steps run the same train_step untimed). train_step's marks, in order:
    micro_steps, optimizer, ngram_update (event steps only)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: dict[int, list[tuple[str, object]]] = {}
        self.ms: dict[int, float] = {}
        self.phase_ms: dict[int, dict[str, float]] = {}

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self, step: int) -> None:
        self.pending[step] = [("start", self._now())]

    def mark(self, step: int, phase: str) -> None:
        """End of `phase` of a started step (no-op for a step that is not timed)."""
        if step in self.pending:
            self.pending[step].append((phase, self._now()))

    def stop(self, step: int) -> None:
        self.pending[step].append(("end", self._now()))
        if not self.cuda:
            self._close(step, self.pending.pop(step))

    def _close(self, step: int, marks: list[tuple[str, object]]) -> None:
        def elapsed_ms(a, b) -> float:
            return a.elapsed_time(b) if self.cuda else (b - a) * 1e3
        self.ms[step] = elapsed_ms(marks[0][1], marks[-1][1])
        self.phase_ms[step] = {phase: elapsed_ms(prev, t)
                               for (_, prev), (phase, t) in zip(marks, marks[1:]) if phase != "end"}

    def resolve(self) -> dict[int, float]:
        """All step times (synchronizes once on CUDA); per-phase times land in `phase_ms`."""
        if self.pending:
            if self.cuda:
                torch.cuda.synchronize()
            for step, marks in self.pending.items():
                self._close(step, marks)
            self.pending.clear()
        return self.ms


# ---------------------------------------------------------------- build

def build_model(cfg: RunConfig, device: torch.device) -> GPT:
    """The GPT on its device: bf16 matrices on CUDA (fp32 masters live in the optimizer)."""
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model).to(device)
    if device.type == "cuda":
        for name, p in model.named_parameters():
            if name in BF16_PARAMS:
                p.data = p.data.to(torch.bfloat16)
    model.resolve_attention_backend(device)
    model.fp8.resolve(device)  # --fp8 where it cannot run (CPU, pre-Hopper GPU) warns, never silently
    return model


def build_optimizer(cfg: RunConfig, model: GPT, ctx: DistributedContext):
    if cfg.train.optimizer == "adamw":
        if ctx.world_size > 1:
            raise ValueError("--optimizer adamw is a single-process baseline; use anvil with torchrun")
        opt = AdamWBaseline(model.named_parameters(), lr=cfg.train.adamw_lr)
    else:
        opt = AnvilAndAdam(build_param_cfgs(model.named_parameters()), cfg.optim,
                           tied_embed_head=(model.embed.weight, model.lm_head))
    opt.set_grad_buffer(model.value_embeds.weight, model.value_embeds.grad_accum)
    return opt


def forward_configs(plans: list[StepPlan], device: torch.device) -> list[ForwardScheduleConfig]:
    """Per-step ForwardScheduleConfig with its tensors made once (no per-step host-to-device copy)."""
    out = []
    for plan in plans:
        out.append(ForwardScheduleConfig(
            mtp_weights=torch.tensor(plan.mtp_weights, dtype=torch.float32, device=device),
            prefix_weight=torch.tensor(plan.prefix_weight, dtype=torch.float32, device=device),
            ws_short=plan.ws_short, ws_long=plan.ws_long, train_max_seq_len=plan.max_seq_len))
    return out


def build(cfg: RunConfig, ctx: DistributedContext, run_dir: Path, graph_backend=None) -> Run:
    """run_dir: claimed already (trainer/run_dir.py). graph_backend: None for CUDA graphs; the CPU
    stand-in (capture_support.RecordingGraphBackend) lets tests run the whole graph path (capture,
    self-check, census, seal) without a GPU."""
    device = ctx.device
    schedule = Schedule(cfg.schedule)
    num_steps = min(schedule.num_steps, cfg.train.max_steps or schedule.num_steps)
    micro_steps = cfg.data.slices_per_step // ctx.world_size
    if micro_steps * ctx.world_size != cfg.data.slices_per_step:
        raise ValueError(f"world size {ctx.world_size} must divide slices_per_step "
                         f"{cfg.data.slices_per_step} (use 1, 2, 4 or 8 GPUs)")
    # one cadence, the schedule's; the table holds one sink gradient per micro-step until its event
    cfg.model.ngram.cycle, cfg.model.ngram.micro_steps = cfg.schedule.ngram_cycle, micro_steps
    model = build_model(cfg, device)
    ngram = NgramStore(model.ngram_table)  # the n-gram table; fills the model's row cache
    if ctx.world_size > 1:
        ngram.shard(ctx.rank, ctx.world_size)  # before any capture or census
    optimizer = build_optimizer(cfg, model, ctx)
    forward_fn, eval_fn = model, model.eval_ce
    if cfg.train.compile:
        # Every key and each validation window is a recompile of the same code; past dynamo's
        # default limit (8) it would silently run eager. HEAD uses 64.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        backend = cfg.train.compile_backend
        forward_fn = torch.compile(model, fullgraph=True, dynamic=False, backend=backend)
        eval_fn = torch.compile(model.eval_ce, fullgraph=True, dynamic=False, backend=backend)
    keys = step_keys(schedule, num_steps=num_steps)
    runner = make_step_runner(cfg.graphs, model=forward_fn, optimizer=optimizer, step_keys=keys,
                              ngram_table=model.ngram_table, value_embeds=model.value_embeds,
                              max_step_tokens=max(k.tokens for k in keys),
                              adam_every=getattr(optimizer, "adam_every", cfg.optim.adam_every),
                              grad_accum_steps=micro_steps, device=device, backend=graph_backend,
                              ngram_ring_slots=cfg.schedule.ngram_cycle * micro_steps)
    prefix = build_prefix_table(mergeable_ranks(), cfg.model.vocab_size).to(device)
    val = load_val_tokens(cfg.data.data_dir, cfg.data.val_tokens)
    plans = [schedule.plan(step) for step in range(num_steps)]
    return Run(cfg=cfg, ctx=ctx, schedule=schedule, num_steps=num_steps, model=model,
               forward_fn=forward_fn, eval_fn=eval_fn, optimizer=optimizer, runner=runner,
               micro_steps=micro_steps, plans=plans, fwd_cfgs=forward_configs(plans, device),
               val_tokens=val, metrics=report.MetricsLog(run_dir, enabled=ctx.is_main),
               run_dir=run_dir, prefix_table=prefix, timer=StepTimer(device), ngram=ngram,
               prefetch=RowPrefetch(ngram), untie_step=untie_step(cfg, schedule))


def untie_step(cfg: RunConfig, schedule: Schedule) -> int | None:
    """Facts 3: embed and lm_head untie at the start of the third stage, made odd so it is an Adam
    step (847 in the speedrun). None with fewer than 3 stages, and for the AdamW baseline, whose
    embed and lm_head are separate parameters from the start."""
    if cfg.train.optimizer == "adamw" or len(schedule.stage_starts) < 3:
        return None
    return schedule.stage_starts[2] | 1


def make_loader(run: Run, state: dict | None = None, seed_offset: int = 0,
                steps: list[int] | None = None) -> LookaheadLoader:
    """The training loader; warmup uses another seed so the timed run starts on unseen order.
    `steps`: the schedule steps the loader's consecutive steps stand for (the warmup visit plan,
    which jumps between stages), so each batch has the shape of the step that consumes it."""
    sched, cfg = run.schedule, run.cfg
    shapes = [SliceShape(s.tokens_per_rank, s.max_seq_len, s.cu_seqlens_rows) for s in cfg.schedule.stages]
    largest = SliceShape(max(s.tokens for s in shapes), max(s.max_seq_len for s in shapes),
                         max(s.cu_seqlens_rows for s in shapes))

    def shape_for_step(step: int) -> SliceShape:
        if steps is not None:
            step = steps[min(step, len(steps) - 1)]
        return shapes[sched.stage_index(min(step, sched.num_steps - 1))]

    return LookaheadLoader(make_train_loader(
        cfg.data.data_dir, shape_for_step, run.ctx.rank, run.ctx.world_size, run.ctx.device,
        seed=cfg.data.seed + seed_offset, max_shape=largest, shuffle=cfg.data.shuffle, state=state,
        slices_per_step=cfg.data.slices_per_step))


# ---------------------------------------------------------------- checkpoints

def _dcp_state(run: Run) -> dict:
    """The DCP state dict: replicated model state under "model", each rank's own state under its
    own keys (optimizer state; the n-gram store: its table row slice, Adam state and update count)."""
    rank = run.ctx.rank
    return {f"optim_rank{rank}": run.optimizer.state_dict(),
            f"ngram_rank{rank}": run.ngram.state_dict(), "model": run.model.state_dict()}


def save_checkpoint(run: Run, steps_done: int) -> Path | None:
    """ckpt_step<steps_done> in the run dir (trainer/checkpoint.py: atomic swap); collective. A step
    this run saved last is not written again (the final save right after a periodic one); None,
    said on its own line, where no exact checkpoint can be taken (an unaligned final step)."""
    path = checkpoint.checkpoint_path(run.run_dir, steps_done)
    if steps_done == run.last_saved_step:
        return path
    period = run.cfg.checkpoint_period
    if not checkpoint.aligned(steps_done, period):
        if run.ctx.is_main:
            tqdm.write(f"checkpoint after step {steps_done} skipped: checkpoints are exact only every "
                       f"{period} steps (no Adam or n-gram gradient held across the boundary)")
        return None
    meta = {"world_size": run.ctx.world_size, "micro_steps": run.micro_steps,
            "loader": run.loader.state_dict() if run.loader else None, "val_curve": run.val_curve,
            "train_time_s": run.train_time_s, "preset": run.cfg.preset}
    checkpoint.save_checkpoint(run.run_dir, steps_done, _dcp_state(run), meta, is_main=run.ctx.is_main)
    run.last_saved_step = steps_done
    if run.ctx.is_main:
        tqdm.write(f"checkpoint {path}")
    return path


def resume_from(run: Run, info: CheckpointInfo) -> int:
    """Load a validated checkpoint in place; returns the first step to run."""
    state = _dcp_state(run)
    checkpoint.load_checkpoint(info, state)
    run.optimizer.load_state_dict(state[f"optim_rank{run.ctx.rank}"])
    steps_done = info.steps_done
    # YaRN tables and scales as they stand after `steps_done` steps (the Python float scales are
    # not in the checkpoint: the window moves are replayed in order from the base tables)
    run.model.reset_yarn()
    for step in range(steps_done):  # a move at step `steps_done` is train_step's to make
        run.model.set_yarn_window(run.schedule.plan(step).ws_long)
    run.val_curve = list(info.meta["val_curve"])
    run.train_time_s = float(info.meta["train_time_s"])
    run.loader = make_loader(run, state=info.meta["loader"])
    if info.path.parent.resolve() == run.run_dir.resolve():
        run.last_saved_step = steps_done  # continuing in place: that checkpoint is this run's
    if run.ctx.is_main:
        print(f"resumed from {info.path} at step {steps_done}", flush=True)
    return steps_done


# ---------------------------------------------------------------- one step

def train_step(run: Run, step: int, loader: LookaheadLoader) -> Tensor:
    """One optimizer step over `micro_steps` micro-batches; returns the mean per-token loss (0-d,
    on the device, owned by the caller). Each micro-step's loss is its sum / micro_steps. The
    step's one-time transitions (YaRN window, embed/head untie) follow the model's and optimizer's
    state, so the warmup may run a step twice or jump over a stage's first step."""
    plan = run.plans[step]
    run.model.set_yarn_window(plan.ws_long)  # at a ws_long change: YaRN tables in place, scales move
    ngram, fwd_cfg = run.ngram, run.fwd_cfgs[step]
    total = torch.zeros((), device=run.ctx.device)
    for micro in range(run.micro_steps):
        batch = loader.next_batch()
        # n-gram rows of this micro-batch from their owners (after the last update event)
        ids, slots = run.prefetch.slots_for(batch.inputs)  # [2T] table rows, [2T] cache slots
        loss = run.runner.forward(step, batch, slots, fwd_cfg, micro_step=micro)
        total += loss  # loss may be graph memory: accumulate before the next replay
        run.prefetch.issue(loader)  # next micro-batch's row-id exchange, hidden under the backward
        ngram_grad = run.runner.backward()
        last = micro == run.micro_steps - 1
        held = run.runner.hold_ngram_grad(ngram_grad, ngram.num_pending, plan.ngram_event and last)
        ngram.hold(held, ids)
    run.timer.mark(step, "micro_steps")
    # ANVIL reduce-scatters read p.grad (graph buffers) before the next step's backward replay.
    run.optimizer.step(step, plan.lr_mul, plan.momentum)
    if step == run.untie_step and run.optimizer.tied:
        run.optimizer.untie_embed_head()  # embed's Adam state <- lm_head's (collective)
    run.timer.mark(step, "optimizer")
    if plan.ngram_event:
        ngram.update_event(step, plan.lr_mul)  # sparse Adam on the held rows, cache refreshed
        run.timer.mark(step, "ngram_update")
    return (total / plan.tokens_per_rank).detach()


@torch.no_grad()
def evaluate(run: Run, ws_short: int, ws_long: int) -> float:
    """Mean per-token CE over the validation tokens (every rank's slices, reduced)."""
    dcfg, device = run.cfg.data, run.ctx.device
    T = dcfg.val_tokens_per_batch  # the preflight checked that every rank gets a batch
    ngram = run.ngram
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    batches = list(val_batches(run.val_tokens, T, dcfg.val_cu_seqlens_rows, run.ctx.rank,
                               run.ctx.world_size, device))
    # Every rank runs the same number of forwards (the n-gram row pull is a collective); a rank
    # with fewer slices repeats its last one without counting it.
    rounds = -(-num_val_slices(run.val_tokens.size, T) // run.ctx.world_size)
    for i in range(rounds):
        batch = batches[min(i, len(batches) - 1)] if batches else None
        if batch is None:
            raise DataError(f"rank {run.ctx.rank} has no validation slice: fewer val slices than "
                            f"ranks; lower --val-tokens-per-batch or add validation data")
        slots = ngram.slots_for(batch.inputs)
        ce = run.eval_fn(batch.inputs, batch.targets, batch.cum_seqlens, slots, ws_short, ws_long, T)
        if i < len(batches):
            loss_sum += ce.double().sum()
            count += ce.numel()
    if run.ctx.world_size > 1:
        stats = torch.stack([loss_sum, count])
        torch.distributed.all_reduce(stats)
        loss_sum, count = stats[0], stats[1]
    return float(loss_sum / count)


# ---------------------------------------------------------------- phases

def _trained_at(run: Run, step: int) -> StepPlan:
    """The plan of the last step trained before a validation at `step` (step 0: the first): its
    stage's YaRN state is the live one."""
    return run.plans[max(min(step, run.num_steps) - 1, 0)]


def validation_windows(run: Run, step: int) -> tuple[int, int]:
    """(ws_short, ws_long) of the validation before `step` trains: the windows the model has been
    trained at so far (_trained_at). After the last step (step == num_steps): the schedule's final
    windows (an extension of the long window at the last stage's YaRN state), or the last step's
    if --max-steps cut the run short."""
    if step >= run.num_steps and run.num_steps == run.schedule.num_steps:
        return run.schedule.final_validation_windows()
    plan = _trained_at(run, step)
    return plan.ws_short, plan.ws_long


def validation_stages(run: Run) -> dict[int, set[tuple[int, int]]]:
    """Stage index -> validation windows of every validation the timed run makes, keyed by the
    stage whose YaRN state it runs in (the last stage also holds the final validation's)."""
    out: dict[int, set[tuple[int, int]]] = {}
    for step in [p.step for p in run.plans if p.validate] + [run.num_steps]:
        out.setdefault(_trained_at(run, step).stage_index, set()).add(validation_windows(run, step))
    return out


@contextmanager
def _counting_compiles(run: Run, phase: str):
    """Adds the graphs dynamo compiles inside the block to run.compiles[phase]."""
    before = compile_cache.graphs_compiled()
    try:
        yield
    finally:
        run.compiles[phase] = run.compiles.get(phase, 0) + compile_cache.graphs_compiled() - before


def _sync(run: Run) -> None:
    if run.ctx.device.type == "cuda":
        torch.cuda.synchronize(run.ctx.device)


def warmup_and_capture(run: Run) -> None:
    """Untimed: visit every key twice (capture, then replay + self-check), both Adam parities,
    n-gram events and every window change, on a warmup data order."""
    keys = step_keys(run.schedule, num_steps=run.num_steps)
    visits = warmup_visit_plan(run.schedule, num_steps=run.num_steps)
    if run.ctx.is_main:
        print(describe_plan(run.schedule, keys, visits), flush=True)
    loader = make_loader(run, seed_offset=10_000, steps=visits)
    t0 = time.perf_counter()
    # Validation windows by stage: each one's eval graph compiles here, in the YaRN state it will
    # run in, so no validation of the timed run stops to compile.
    to_validate = validation_stages(run)
    ngram = run.ngram
    with _counting_compiles(run, "warmup"):
        try:
            for i, step in enumerate(visits):
                plan = run.plans[step]
                loss = train_step(run, step, loader)
                if run.stop.should_stop(step, at_boundary=True):
                    raise _Stopped
                if ngram.num_pending and i + 1 < len(visits) and visits[i + 1] != step + 1:
                    # The steps the plan skips here would have applied the held gradients (an
                    # event comes every ngram_cycle steps); without this the next block overflows
                    # the ring (cycle x micro_steps slots). Collective: every rank has the plan.
                    ngram.update_event(step, plan.lr_mul)
                if run.ctx.is_main:
                    print(f"warmup step {step:5d} ({plan.stage}) loss {float(loss):.4f} "
                          f"[{time.perf_counter() - t0:.0f} s]", flush=True)
                for ws_short, ws_long in sorted(to_validate.pop(plan.stage_index, ())):
                    evaluate(run, ws_short, ws_long)  # compiles this window's eval graph
                    if run.ctx.is_main:
                        print(f"warmup validation windows ({ws_short}, {ws_long}) compiled "
                              f"[{time.perf_counter() - t0:.0f} s]", flush=True)
            if to_validate:
                raise RuntimeError(f"warmup never visited stages {sorted(to_validate)} (validation "
                                   f"windows left uncompiled); the visit plan must reach every stage")
        finally:
            loader.close()
            run.prefetch.reset()  # its pending request belongs to the warmup loader
        _sync(run)
    run.warmup_s = time.perf_counter() - t0
    if run.ctx.is_main and run.cfg.train.compile:
        # where the compile time went (dynamo / AOT / inductor phases), for the run log
        print(torch._dynamo.utils.compile_times(repr="str", aggregate=True), flush=True)


def timed_run(run: Run, start_step: int) -> None:
    """Steps [start_step, num_steps), or until a signal's stop at a checkpoint boundary (run.stop)."""
    cfg = run.cfg
    run.loader = run.loader or make_loader(run)
    bar = tqdm(range(start_step, run.num_steps), desc="train", disable=not run.ctx.is_main,
               file=sys.stdout, mininterval=1.0)
    run.compiles.setdefault("timed", 0)
    run.steps_done = start_step
    _sync(run)
    clock = time.perf_counter()

    @contextmanager
    def clock_paused():
        """Work that is not training (validation, checkpoints, trace export) stops the clock."""
        nonlocal clock
        _sync(run)
        run.train_time_s += time.perf_counter() - clock
        yield
        _sync(run)
        clock = time.perf_counter()

    tokens = 0  # per rank, since start_step (stages differ in tokens per step)
    run.resumed_train_time_s = run.train_time_s  # > 0 after --resume: not this process's time
    profiler = _step_profiler(run, start_step)
    for step in bar:
        plan = run.plans[step]
        if plan.validate:
            with clock_paused():
                _validate(run, step, *validation_windows(run, step))
        if profiler is not None:
            profiler.before(step)
        run.timer.start(step)
        with _counting_compiles(run, "timed"):
            loss_t = train_step(run, step, run.loader)  # read only at log steps (a host sync)
        run.timer.stop(step)
        tokens += run.micro_steps * plan.tokens_per_rank
        if profiler is not None and step == profiler.end - 1:
            with clock_paused():
                run.profile = profiler.after(step)
            tqdm.write(f"profiled steps {profiler.start}-{step}: {run.profile['kernel_ms']:.1f} ms of "
                       f"kernels, {run.profile['device_busy_ms']:.1f} ms busy per step; "
                       f"{run.run_dir / 'profile.json'}")
        if (step + 1) % cfg.train.log_every == 0 or step == run.num_steps - 1:
            loss = float(loss_t)
            elapsed = run.train_time_s + time.perf_counter() - clock
            this_process = elapsed - run.resumed_train_time_s
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens / max(this_process, 1e-9):.0f}")
            run.metrics.log(kind="train", step=step, stage=plan.stage, loss=loss,
                            train_time_s=elapsed, lr_mul=plan.lr_mul, epoch=run.loader.epoch)
        steps_done = run.steps_done = step + 1
        if cfg.train.save_every and steps_done % cfg.train.save_every == 0:
            with clock_paused():
                save_checkpoint(run, steps_done)
        if run.stop.should_stop(steps_done, checkpoint.aligned(steps_done, cfg.checkpoint_period)):
            break
    _sync(run)
    run.train_time_s += time.perf_counter() - clock
    bar.close()


def _step_profiler(run: Run, start_step: int) -> StepProfiler | None:
    """--profile-steps on rank 0 (checked against the run's timed steps by the preflight)."""
    window = run.cfg.train.profile_steps
    if window is None or not run.ctx.is_main:
        return None
    return StepProfiler(*window, run.run_dir, cuda=run.ctx.device.type == "cuda")


def _validate(run: Run, step: int, ws_short: int, ws_long: int) -> float:
    with _counting_compiles(run, "validation"):
        val = evaluate(run, ws_short, ws_long)
    run.val_curve.append({"step": step, "val_loss": val, "train_time_s": run.train_time_s})
    run.metrics.log(kind="val", step=step, val_loss=val, train_time_s=run.train_time_s,
                    ws_short=ws_short, ws_long=ws_long)
    if run.ctx.is_main:
        tqdm.write(f"step {step}: val loss {val:.4f} (train time {run.train_time_s:.1f} s)")
    return val


def step_times(run: Run) -> list[dict]:
    """[{stage, step, step_ms, phase_ms: {phase: ms}}] of every timed step."""
    ms = run.timer.resolve()
    return [{"stage": run.plans[s].stage, "step": s, "step_ms": ms[s],
             "phase_ms": run.timer.phase_ms.get(s, {})} for s in sorted(ms)]


def _run_facts(run: Run) -> dict:
    """What every run report starts with (summary.json and warmup.json)."""
    cfg, ctx = run.cfg, run.ctx
    return {
        "preset": cfg.preset, "git_revision": report.git_revision(),
        "device": torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu",
        "world_size": ctx.world_size, "micro_steps": run.micro_steps, "warmup_s": run.warmup_s,
        "wall_s": time.perf_counter() - run.started, "compiles": dict(run.compiles),
        "compile_cache": run.compile_cache, "graphs": cfg.graphs.mode,
        "attention_backend": run.model.attention_backend,
        "capture_report": run.runner.capture_report(),
        "peak_memory_gib": (torch.cuda.max_memory_allocated(ctx.device) / 2**30
                            if ctx.device.type == "cuda" else None),
        "config": cfg.to_dict(),
    }


def summarize(run: Run, start_step: int, times: list[dict]) -> dict:
    """summary.json; `times`: step_times(run)."""
    tokens = sum(run.micro_steps * p.tokens_per_rank for p in run.plans[start_step:])
    # a resumed run's clock also holds the checkpoint's time: tokens/s uses this process's only
    this_process_s = run.train_time_s - run.resumed_train_time_s
    return {
        **_run_facts(run),
        "steps": run.num_steps - start_step, "start_step": start_step,
        "tokens_per_rank": tokens, "train_time_s": run.train_time_s,
        "train_time_this_process_s": this_process_s,
        "tokens_per_s_per_gpu": tokens / max(this_process_s, 1e-9),
        "ms_per_step_by_stage": report.stage_ms_per_step(times),
        "phase_ms_by_stage": report.stage_phase_ms(times),
        "profile": run.profile,  # --profile-steps (those steps also ran slower: profiler overhead)
        "val_curve": run.val_curve, "final_val_loss": run.val_curve[-1]["val_loss"] if run.val_curve else None,
        "epochs_seen": run.loader.epoch if run.loader else 0,
    }


def _finish_warmup_only(run: Run) -> int:
    """--warmup-only: every key compiled, captured, self-checked and sealed; write warmup.json."""
    if run.ctx.is_main:
        report.write_json_atomic(run.run_dir / "warmup.json", _run_facts(run))
        print(f"warmup only: {run.compiles.get('warmup', 0)} graphs compiled in "
              f"{run.warmup_s:.1f} s; {run.run_dir / 'warmup.json'}", flush=True)
    return 0


@contextmanager
def deterministic_mode(enabled: bool):
    """--deterministic: torch.use_deterministic_algorithms(True, warn_only=True) for the run, with
    cuBLAS's workspace setting it needs (CUBLAS_WORKSPACE_CONFIG, when not set already) and without
    filling new tensors with NaN (torch's default in this mode; the trainer reads no uninitialised
    memory, and the fill costs a kernel per allocation). inductor follows the same switch (it
    falls back to deterministic index_put/scatter instead of atomic adds). Ops with no
    deterministic kernel warn, naming the op, instead of failing the run. Restores the previous
    settings on exit, so runs in one process (tests) do not leak the mode."""
    if not enabled:
        yield
        return
    prev = (torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.utils.deterministic.fill_uninitialized_memory,
            os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev[0], warn_only=prev[1])
        torch.utils.deterministic.fill_uninitialized_memory = prev[2]
        if prev[3] is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: flags -> RunConfig (bad flags exit 2) -> train()."""
    return train(config_mod.parse(argv))


def train(cfg: RunConfig, graph_backend=None) -> int:
    """The whole run in its phases; returns the process exit code (2: bad data or checkpoint).
    graph_backend: see build()."""
    with deterministic_mode(cfg.train.deterministic):
        return _train(cfg, graph_backend)


class _Stopped(Exception):
    """A signal during the warmup: nothing trained, nothing to save."""


def _claim(cfg: RunConfig, ctx: DistributedContext, pre) -> RunDir | None:
    """Rank 0 claims the run dir (lock, clean-up); every rank learns whether it could."""
    handle, error = None, None
    if ctx.is_main:
        try:
            handle = claim_run_dir(pre.run_dir, overwrite=cfg.train.overwrite,
                                   resume_in_place=pre.resume_in_place)
        except RunDirError as e:
            error = str(e)
    if ctx.world_size > 1:
        box = [error]
        torch.distributed.broadcast_object_list(box, src=0, group=ctx.health_group)
        error = box[0]
    if error is not None:
        raise RunDirError(error)
    return handle


def _prepare(cfg: RunConfig, ctx: DistributedContext, pre, stop: GracefulStop, graph_backend,
             started: float) -> Run:
    """Build, warm up + capture (or skip), reset, census, seal: everything before the timed run."""
    cache_log = compile_cache.load(cfg.train.compile_cache) if cfg.train.compile_cache else {}
    run = build(cfg, ctx, pre.run_dir, graph_backend)
    run.started, run.compile_cache, run.stop = started, cache_log, stop
    if ctx.is_main and cache_log:
        print(f"compile cache: {cache_log}", flush=True)
    if ctx.is_main:
        print(f"run dir {run.run_dir}; attention backend {run.model.attention_backend}; "
              f"{ctx.world_size} rank(s) x {run.micro_steps} micro-step(s); validation "
              f"{num_val_slices(run.val_tokens.size, cfg.data.val_tokens_per_batch)} batch(es) of "
              f"{cfg.data.val_tokens_per_batch} tokens", flush=True)
        report.write_json_atomic(run.run_dir / "config.json", cfg.to_dict())
    initial = snapshot_state(run)
    if cfg.train.compile or cfg.graphs.mode != "off":
        warmup_and_capture(run)
        census_before = baked_addresses.take_census(run.model, run.runner)
        restore_state(run, initial)  # in place: parameters, optimizer, tables, YaRN
        run.ngram.reset()  # in place: the n-gram table slice and its Adam state (not the model's)
        baked_addresses.compare(census_before, baked_addresses.take_census(run.model, run.runner))
        if cfg.train.compile_cache and ctx.is_main:
            # every graph of the run is compiled now (the summary's compiles show none later)
            run.compile_cache["saved"] = compile_cache.save(cfg.train.compile_cache)
    elif ctx.is_main:
        print("warmup skipped: an uncompiled eager model has nothing to compile or capture", flush=True)
    run.runner.seal()
    return run


def _finish(run: Run, start_step: int) -> int:
    """After the timed run: final validation and checkpoint, summary and plots; or, after a
    signal, the stop checkpoint and how to resume. Returns the exit code."""
    cfg, ctx, stop = run.cfg, run.ctx, run.stop
    steps_done = run.steps_done
    if stop.requested:
        path = save_checkpoint(run, steps_done)
        run.metrics.log(kind="stop", step=steps_done, signal=stop.signal_name,
                        checkpoint=str(path) if path else None)
        if ctx.is_main:
            where = (f"checkpoint {path}; resume with the same flags plus --resume {run.run_dir}"
                     if path else "no checkpoint could be taken at this step")
            print(f"stopped by {stop.signal_name} after step {steps_done}: {where}", flush=True)
        if run.loader is not None:
            run.loader.close()
        return stop.exit_code
    _validate(run, run.num_steps, *validation_windows(run, run.num_steps))
    if cfg.train.save_final:
        save_checkpoint(run, run.num_steps)
    if ctx.is_main:
        times = step_times(run)
        summary = summarize(run, start_step, times)
        report.write_json_atomic(run.run_dir / "summary.json", summary)
        report.plot_run(run.run_dir, run.metrics.records, times)
        print(f"done: {summary['steps']} steps, {summary['tokens_per_rank']} tokens/rank, "
              f"train time {summary['train_time_s']:.1f} s, final val loss "
              f"{summary['final_val_loss']:.4f}; summary {run.run_dir / 'summary.json'}", flush=True)
    if run.loader is not None:
        run.loader.close()
    return 0


EXIT_ERRORS = (DataError, CheckpointError, CompileCacheError, RunDirError, PreflightError)


def _report_lost_ranks(ctx: DistributedContext, error: RuntimeError, run_dir: Path | None) -> None:
    """A collective failed because a peer is gone: name it (distributed.lost_ranks) and say how to
    go on. Rank 0 hosts the rendezvous store: if it is the one gone, the store cannot answer."""
    first_line = str(error).strip().splitlines()[0][:200]
    try:
        lost = lost_ranks(ctx, "after-failure", wait_s=10.0)
        who = f"rank(s) {lost} stopped answering" if lost else "every rank still answers"
    except Exception:  # the store is gone with rank 0
        who = "rank 0 (it hosts the rendezvous store) stopped answering"
    where = f"; resume with --resume {run_dir} once every rank runs" if run_dir else ""
    print(f"error: rank {ctx.rank}: a collective failed ({first_line}): {who}{where}",
          file=sys.stderr, flush=True)


def _train(cfg: RunConfig, graph_backend) -> int:
    started = time.perf_counter()
    try:
        check_device(cfg)  # before the process group binds a device
    except PreflightError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ctx = init_distributed(cfg.train.timeout_s, None if cfg.train.device == "auto" else cfg.train.device)
    if ctx.is_main and cfg.train.deterministic:
        print("deterministic mode: torch.use_deterministic_algorithms(True, warn_only=True)", flush=True)
    handle, trained, run_dir = None, False, None
    stop = GracefulStop(ctx)
    try:
        with stop:
            pre = preflight(cfg, ctx)
            run_dir = pre.run_dir
            handle = _claim(cfg, ctx, pre)
            run = _prepare(cfg, ctx, pre, stop, graph_backend, started)
            if cfg.train.warmup_only:
                trained = True  # warmup.json is the result: keep the run dir
                return _finish_warmup_only(run)
            run.model.set_prefix_table(run.prefix_table)
            start_step = 0
            if pre.resume is not None:
                info = checkpoint.resolve_resume(pre.resume.path if not pre.resume_in_place
                                                 else pre.resume.path.with_suffix(""))
                start_step = resume_from(run, info)
                if pre.resume_in_place and ctx.is_main:
                    truncate_metrics(run.run_dir, start_step)
            trained = True
            timed_run(run, start_step)
            return _finish(run, start_step)
    except _Stopped:
        if ctx.is_main:
            print(f"stopped by {stop.signal_name} before the first training step: nothing to resume"
                  + ("; the run dir is removed" if handle is not None and handle.created else ""),
                  file=sys.stderr, flush=True)
        return stop.exit_code
    except EXIT_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        if ctx.world_size == 1 or not is_comm_failure(e):
            raise
        _report_lost_ranks(ctx, e, run_dir)
        return 1
    finally:
        if handle is not None:
            handle.release(remove=not trained)
        destroy_distributed()


if __name__ == "__main__":
    sys.exit(main())
