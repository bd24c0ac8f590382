"""The run's phases around train_step: warmup + capture, the timed run, validation.

Warmup (untimed): the capture plan's visits (perf/cuda_graphs/capture_plan.py) run train_step on
a warmup data order: every key captured at its first visit and replayed + self-checked at its
second, both Adam parities, n-gram events, every window change, and every validation window's
eval graph compiled in the YaRN state it will run in. A signal stops it at the next visit
(nothing trained, nothing to save).

Timed run: steps [start, num_steps) under the train clock (validation and checkpoints pause it),
a train record every `log_every` steps (the one host sync of a step, reading the loss), periodic
checkpoints, and the graceful stop at the next checkpoint boundary after a signal; with
--update-norms the probed steps' per-parameter update sizes (trainer/update_norms.py, outside
the step's timer and the clock).
"""

from __future__ import annotations

import sys
import time

import torch
from tqdm import tqdm

from track_1_short.perf.cuda_graphs.capture_plan import describe_plan, step_keys, warmup_visit_plan
from track_1_short.perf.profiling import StepProfiler
from track_1_short.schedule import StepPlan
from track_1_short.trainer import checkpoint
from track_1_short.trainer.build import make_loader
from track_1_short.trainer.state import Run, RunSpec
from track_1_short.trainer.step import evaluate, train_step
from track_1_short.trainer.stop import StoppedBeforeTraining
from track_1_short.trainer.timing import TrainClock, counting_compiles, sync
from track_1_short.trainer.update_norms import UpdateNorms, model_tensors


# ---------------------------------------------------------------- validation

def _validated_at(spec: RunSpec, step: int) -> StepPlan:
    """The plan whose windows and YaRN state the validation before `step` runs in: the last step
    trained before it (step 0: the first), or with ScheduleConfig.stage_start_validation "next"
    the step about to train (the two differ only at a stage's first step). After the last step:
    the last one."""
    if step < spec.num_steps and spec.cfg.schedule.stage_start_validation == "next":
        return spec.plans[step]
    return spec.plans[max(min(step, spec.num_steps) - 1, 0)]


def validation_windows(spec: RunSpec, step: int) -> tuple[int, int]:
    """(ws_short, ws_long) of the validation before `step` trains: those of _validated_at (the
    windows trained so far, or at a stage's first step with "next" the new stage's). After the
    last step (step == num_steps): the schedule's final windows (an extension of the long window
    at the last stage's YaRN state), or the last step's if --max-steps cut the run short."""
    if step >= spec.num_steps and spec.num_steps == spec.schedule.num_steps:
        return spec.schedule.final_validation_windows()
    plan = _validated_at(spec, step)
    return plan.ws_short, plan.ws_long


def validation_stages(spec: RunSpec) -> dict[int, set[tuple[int, int]]]:
    """Stage index -> validation windows of every validation the timed run makes, keyed by the
    stage whose YaRN state it runs in (the last stage also holds the final validation's)."""
    out: dict[int, set[tuple[int, int]]] = {}
    if not spec.cfg.train.validation:
        return out
    for step in [p.step for p in spec.plans if p.validate] + [spec.num_steps]:
        out.setdefault(_validated_at(spec, step).stage_index, set()).add(validation_windows(spec, step))
    return out


def validate(run: Run, step: int) -> float:
    """The validation before `step` trains (step == num_steps: the final one), logged. YaRN first
    serves _validated_at's window: a no-op except with stage_start_validation "next" at a stage's
    first step, where it moves to the new stage's (train_step's own call then finds it there)."""
    ws_short, ws_long = validation_windows(run.spec, step)
    if step < run.spec.num_steps:
        run.parts.model.set_yarn_window(_validated_at(run.spec, step).ws_long)
    with counting_compiles(run.log.compiles, "validation"):
        val = evaluate(run.spec, run.parts, run.val_tokens, ws_short, ws_long)
    progress = run.progress
    progress.val_curve.append({"step": step, "val_loss": val, "train_time_s": progress.train_time_s})
    run.log.metrics.log(kind="val", step=step, val_loss=val, train_time_s=progress.train_time_s,
                        ws_short=ws_short, ws_long=ws_long)
    if run.spec.ctx.is_main:
        tqdm.write(f"step {step}: val loss {val:.4f} (train time {progress.train_time_s:.1f} s)")
    return val


# ---------------------------------------------------------------- warmup

def _flush_gap(run: Run, visits: list[int], i: int) -> None:
    """The steps the visit plan skips after visit i would have applied the held n-gram gradients
    (the plan's ngram_event steps); without this the next block holds more than the store's bound
    (NgramStore.max_held gradients) and fails. Collective: every rank has the plan."""
    ngram, step = run.parts.ngram, visits[i]
    if ngram.num_pending and i + 1 < len(visits) and visits[i + 1] != step + 1:
        ngram.update_event(step, run.spec.plans[step].lr_mul)


def warmup_and_capture(run: Run) -> None:
    """Untimed: visit every key twice (capture, then replay + self-check), both Adam parities,
    n-gram events and every window change, on a warmup data order."""
    spec, parts, is_main = run.spec, run.parts, run.spec.ctx.is_main
    keys = step_keys(spec.schedule, num_steps=spec.num_steps)
    # every step-graph key and every optimizer cadence visited twice (capture, then self-check)
    visits = parts.optimizer.warmup_visits(warmup_visit_plan(spec.schedule, num_steps=spec.num_steps))
    if is_main:
        print(describe_plan(spec.schedule, keys, visits), flush=True)
    loader = make_loader(spec, seed_offset=10_000, steps=visits)
    t0 = time.perf_counter()
    to_validate = validation_stages(spec)  # each window's eval graph compiles in its stage
    with counting_compiles(run.log.compiles, "warmup"):
        try:
            for i, step in enumerate(visits):
                plan = spec.plans[step]
                loss = train_step(spec, parts, step, loader, run.log.timer)
                if run.stop.should_stop(step, at_boundary=True):
                    raise StoppedBeforeTraining
                _flush_gap(run, visits, i)
                if is_main:
                    print(f"warmup step {step:5d} ({plan.stage}) loss {float(loss):.4f} "
                          f"[{time.perf_counter() - t0:.0f} s]", flush=True)
                for ws_short, ws_long in sorted(to_validate.pop(plan.stage_index, ())):
                    evaluate(spec, parts, run.val_tokens, ws_short, ws_long)  # compiles the window
                    if is_main:
                        print(f"warmup validation windows ({ws_short}, {ws_long}) compiled "
                              f"[{time.perf_counter() - t0:.0f} s]", flush=True)
            if to_validate:
                raise RuntimeError(f"warmup never visited stages {sorted(to_validate)} (validation "
                                   f"windows left uncompiled); the visit plan must reach every stage")
        finally:
            loader.close()
            parts.prefetch.reset()  # its pending request belongs to the warmup loader
        sync(spec.ctx.device)
    run.log.warmup_s = time.perf_counter() - t0
    if is_main and spec.cfg.train.compile:
        # where the compile time went (dynamo / AOT / inductor phases), for the run log
        print(torch._dynamo.utils.compile_times(repr="str", aggregate=True), flush=True)


# ---------------------------------------------------------------- timed run

def _step_profiler(run: Run) -> StepProfiler | None:
    """--profile-steps on rank 0 (checked against the run's timed steps by the preflight)."""
    window = run.spec.cfg.train.profile_steps
    if window is None or not run.spec.ctx.is_main:
        return None
    return StepProfiler(*window, run.spec.run_dir, cuda=run.spec.ctx.device.type == "cuda")


def _after_profile(run: Run, profiler: StepProfiler, step: int, clock: TrainClock) -> None:
    with clock.paused():
        run.log.profile = profiler.after(step)
    tqdm.write(f"profiled steps {profiler.start}-{step}: {run.log.profile['kernel_ms']:.1f} ms of "
               f"kernels, {run.log.profile['device_busy_ms']:.1f} ms busy per step; "
               f"{run.spec.run_dir / 'profile.json'}")


def _update_norms(run: Run) -> UpdateNorms | None:
    """--update-norms: the probe over the model's parameters and this rank's n-gram table."""
    window = run.spec.cfg.train.update_norm_steps
    if window is None:
        return None
    return UpdateNorms(model_tensors(run.parts.model, run.parts.ngram.table), window)


def timed_run(run: Run, start_step: int) -> None:
    """Steps [start_step, num_steps), or until a signal's stop at a checkpoint boundary (run.stop)."""
    spec, progress, log = run.spec, run.progress, run.log
    progress.loader = progress.loader or make_loader(spec)
    bar = tqdm(range(start_step, spec.num_steps), desc="train", disable=not spec.ctx.is_main,
               file=sys.stdout, mininterval=1.0)
    log.compiles.setdefault("timed", 0)
    progress.steps_done = start_step
    progress.resumed_train_time_s = progress.train_time_s  # > 0 after --resume: not this process's
    clock, profiler, tokens = TrainClock(progress, spec.ctx.device), _step_profiler(run), 0
    norms = _update_norms(run)
    clock.start()
    for step in bar:
        plan = spec.plans[step]
        if plan.validate and spec.cfg.train.validation:
            with clock.paused():
                validate(run, step)
        if profiler is not None:
            profiler.before(step)
        probe = norms is not None and norms.probes(step)
        if probe:
            with clock.paused():
                norms.before()
        log.timer.start(step)
        with counting_compiles(log.compiles, "timed"), log.syncs.count(step):
            loss_t = train_step(spec, run.parts, step, progress.loader, log.timer)
        log.timer.stop(step)
        if probe:
            with clock.paused():
                moved = norms.after()
            if spec.ctx.is_main:
                log.metrics.log(kind="update_norms", step=step, stage=plan.stage, norms=moved)
        tokens += spec.micro_steps * plan.tokens_per_rank  # per rank, since start_step
        if profiler is not None and step == profiler.end - 1:
            _after_profile(run, profiler, step, clock)
        if (step + 1) % spec.cfg.train.log_every == 0 or step == spec.num_steps - 1:
            loss, elapsed = float(loss_t), clock.elapsed_s()  # float(): the step's one host sync
            this_process = elapsed - progress.resumed_train_time_s
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens / max(this_process, 1e-9):.0f}")
            log.metrics.log(kind="train", step=step, stage=plan.stage, loss=loss, train_time_s=elapsed,
                            lr_mul=plan.lr_mul, epoch=progress.loader.epoch)
        steps_done = progress.steps_done = step + 1
        if spec.cfg.train.save_every and steps_done % spec.cfg.train.save_every == 0:
            with clock.paused():
                checkpoint.save_run(spec, run.parts, progress, steps_done)
        if run.stop.should_stop(steps_done, checkpoint.aligned(spec.plans, steps_done)):
            break
    clock.stop()
    bar.close()
