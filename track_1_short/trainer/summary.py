"""What a run reports: summary.json (timed run) and warmup.json (--warmup-only), and the per-step
times they and the plots are built from.

summary.json: the run facts (preset, git revision, device, ranks, compiles, capture report, peak
memory, config), train time, tokens/s per GPU (this process's steps and time only, so a resumed
run is not credited with the checkpoint's time), ms per step and per phase by stage, the profile,
the val curve, epochs seen.
"""

from __future__ import annotations

import time

import torch

from track_1_short import report
from track_1_short.trainer.state import Run


def step_times(run: Run) -> list[dict]:
    """[{stage, step, step_ms, host_ms, syncs, phase_ms: {phase: ms}}] of every timed step
    (step_ms: device time; host_ms: host issue time; syncs: host syncs, None on CPU)."""
    timer, syncs = run.log.timer, run.log.syncs.per_step
    ms = timer.resolve()
    return [{"stage": run.spec.plans[s].stage, "step": s, "step_ms": ms[s],
             "host_ms": timer.host_ms.get(s), "syncs": syncs.get(s),
             "phase_ms": timer.phase_ms.get(s, {})} for s in sorted(ms)]


def run_facts(run: Run) -> dict:
    """What every run report starts with (summary.json and warmup.json)."""
    cfg, ctx, log = run.spec.cfg, run.spec.ctx, run.log
    return {
        "preset": cfg.preset, **report.code_identity(),
        "device": torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu",
        "world_size": ctx.world_size, "micro_steps": run.spec.micro_steps, "warmup_s": log.warmup_s,
        "wall_s": time.perf_counter() - log.started, "compiles": dict(log.compiles),
        "compile_cache": log.compile_cache, "graphs": cfg.graphs.mode,
        "attention_backend": run.parts.model.attention_backend,
        "capture_report": run.parts.runner.capture_report(),
        "optimizer_capture_report": run.parts.optimizer.capture_report(),
        "peak_memory_gib": (torch.cuda.max_memory_allocated(ctx.device) / 2**30
                            if ctx.device.type == "cuda" else None),
        "config": cfg.to_dict(),
    }


def summarize(run: Run, start_step: int, times: list[dict]) -> dict:
    """summary.json; `times`: step_times(run)."""
    spec, progress = run.spec, run.progress
    tokens = sum(spec.micro_steps * p.tokens_per_rank for p in spec.plans[start_step:])
    # a resumed run's clock also holds the checkpoint's time: tokens/s uses this process's only
    this_process_s = progress.train_time_s - progress.resumed_train_time_s
    curve = progress.val_curve
    return {
        **run_facts(run),
        "steps": spec.num_steps - start_step, "start_step": start_step,
        "tokens_per_rank": tokens, "train_time_s": progress.train_time_s,
        "train_time_this_process_s": this_process_s,
        "tokens_per_s_per_gpu": tokens / max(this_process_s, 1e-9),
        "ms_per_step_by_stage": report.stage_ms_per_step(times),
        "phase_ms_by_stage": report.stage_phase_ms(times),
        # the host regime: how long the host took to issue a step (vs ms_per_step, the device's),
        # and how often it waited for the device inside one
        "host_issue_ms_by_stage": report.stage_ms_per_step(times, "host_ms"),
        "host_syncs_per_step_by_stage": report.stage_syncs_per_step(times),
        "profile": run.log.profile,  # --profile-steps (those steps ran slower: profiler overhead)
        "val_curve": curve, "final_val_loss": curve[-1]["val_loss"] if curve else None,
        "epochs_seen": progress.loader.epoch if progress.loader else 0,
    }


def write_summary(run: Run, start_step: int) -> dict:
    """summary.json, steps.json (every timed step's times) and the plots (rank 0); returns the
    summary."""
    times = step_times(run)
    summary = summarize(run, start_step, times)
    report.write_json_atomic(run.spec.run_dir / "summary.json", summary)
    report.write_json_atomic(run.spec.run_dir / "steps.json", times)
    report.plot_run(run.spec.run_dir, run.log.metrics.records, times)
    return summary


def write_warmup_report(run: Run) -> None:
    """--warmup-only: every key compiled, captured, self-checked and sealed; warmup.json (rank 0)."""
    report.write_json_atomic(run.spec.run_dir / "warmup.json", run_facts(run))
    print(f"warmup only: {run.log.compiles.get('warmup', 0)} graphs compiled in "
          f"{run.log.warmup_s:.1f} s; {run.spec.run_dir / 'warmup.json'}", flush=True)
