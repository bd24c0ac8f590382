"""The trainer's real step at one stage: train_step (model, optimizer, n-gram events, loader) for N
steps without the stages before it, graphs on and/or off, as JSON.

What it measures (one process, one GPU; each variant a fresh trainer run of the chosen stage
alone: its key compiles once, the warmup captures and self-checks it, then --steps timed steps):
- step_ms: the device's time per step (CUDA events at step boundaries, trainer/timing.StepTimer):
  median / p10 / p90 over the timed steps, and by parity (odd steps are Adam steps);
- phases_ms: micro_steps (per step and per micro-step: forward + backward replays, the loader,
  the n-gram row exchange and the gradient hold), optimizer on even / odd steps, the n-gram
  update event (event steps), and mfu_micro_step (model FLOPs of one micro-step by bench/model.py's
  formula over the micro-step time, 790 TFLOP/s);
- host_issue_ms: the host's time to issue a step (below step_ms: the GPU is the bottleneck),
  host_syncs_per_step (torch.cuda.set_sync_debug_mode counts, trainer/timing.SyncCounter);
- with --profile (default on CUDA): a torch.profiler window of --profile-steps steps (default 2;
  more makes the window's start, when the queue may be empty, weigh less in gpu_busy) after the
  timed ones:
  kernel_ms_per_step, device_busy_ms_per_step, gpu_busy (the busy share of the device's timeline
  inside the window, perf/profiling.kernel_stats's busy_fraction), kernels_per_step and
  top_kernels (the 30 kernel names by time per step: where the GPU time goes); --trace-dir DIR
  keeps each variant's chrome trace of that window as DIR/trace_<stage>_<graphs>.json.gz (for
  chrome://tracing or Perfetto: the gaps between kernels and what the host did meanwhile);
- peak memory, recompiles during the timed steps (must be 0), the warmup's seconds.
Deviations from the full schedule, which change no kernel's work: YaRN tables are the base ones
(the stage's windows are used, its attention scale is not the chained one); the embed/lm_head
untie happens after step 3 for stages C and D (UNTIE_STEP; the run unties at step 847), and
the statistics start after it.

Run (H200): PYTHONPATH=. python bench/step.py --stage C --steps 20 --graphs on,off \\
    --out docs/results/step_h200_C.json   (add --micro-steps 1 for one rank's step of 8 GPUs;
    --set SECTION.FIELD=VALUE for a config variant, e.g. --set model.fp8.enabled=true;
    --model-profile record for the record's architecture, as the trainer's flag)
Smoke (CPU, cpu-tiny model, eager): PYTHONPATH=. python bench/step.py --smoke --out /tmp/step.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import common
from bench import model as model_bench
from track_1_short import config as config_mod
from track_1_short.atomic_io import copy_file_atomic
from track_1_short.constants import H200_DENSE_BF16_TFLOPS
from track_1_short.distributed import destroy_distributed, init_distributed
from track_1_short.perf import blas
from track_1_short.schedule import SPEEDRUN_STAGES
from track_1_short.trainer.build import describe_strategies
from track_1_short.trainer.lifecycle import prepare_run
from track_1_short.trainer.phases import timed_run
from track_1_short.trainer.preflight import preflight
from track_1_short.trainer.run_dir import claim_run_dir
from track_1_short.trainer.stop import GracefulStop
from track_1_short.trainer.summary import step_times
from track_1_short.trainer.timing import MICRO_PHASES

PROFILE_STEPS = 2
MAX_PROFILE_STEPS = config_mod.MAX_PROFILE_STEPS  # the trainer's --profile-steps limit
UNTIE_STEP = 3  # stages C, D: tied Adam on steps 1 and 3 (the warmup visits that cadence twice)


def base_config(args):
    """The bench's preset with the model profile, then the --set items applied (as the trainer's
    --model-profile and --set; ValueError if bad)."""
    return config_mod.with_profile_and_sets(config_mod.preset("cpu-tiny" if args.smoke else "small-gpu"),
                                            args.model_profile, args.set)


def stage_config(args, graphs: str, runs_dir: Path):
    """The preset (with --set) with one stage (the chosen one, --steps long plus the profile window)."""
    cfg = base_config(args)
    index = [s.name for s in SPEEDRUN_STAGES].index(args.stage)
    base = cfg.schedule.stages[min(index, len(cfg.schedule.stages) - 1)]
    profile = args.profile_steps if args.profile else 0
    stage = dataclasses.replace(base, num_steps=args.steps + profile, extension=False)
    # stages C and D run untied, as in the run from step 847 on: untie after step UNTIE_STEP, so
    # the warmup captures both Adam cadences; the steady window starts after it
    cfg.schedule = dataclasses.replace(cfg.schedule, stages=(stage,), momentum_warmup_steps=0,
                                       momentum_cooldown_steps=0,
                                       untie_step=UNTIE_STEP if index >= 2 else None)
    cfg.graphs.mode = graphs if not args.smoke else "off"
    cfg.data.data_dir, cfg.data.micro_steps = Path(args.data_dir), args.micro_steps
    cfg.train = dataclasses.replace(
        cfg.train, validation=False, save_final=False, save_every=0, log_every=10**6,
        runs_dir=runs_dir, run_id=f"{args.stage}-{graphs}", overwrite=True,
        profile_steps=(args.steps, args.steps + profile) if profile else None)
    return cfg, index


def _stats(xs: list[float]) -> dict | None:
    return common.summarize(xs) if xs else None


def _field(cfg, key: str):
    """The value at dotted path `key` of the run's config (what a --set item reached)."""
    for name in key.split("."):
        cfg = getattr(cfg, name)
    return list(cfg) if isinstance(cfg, tuple) else cfg


def phases(times: list[dict], micro_steps: int) -> dict:
    by = {p: [t["phase_ms"][p] for t in times if p in t["phase_ms"]]
          for p in ("micro_steps", "optimizer", "ngram_update")}
    even = [t["phase_ms"]["optimizer"] for t in times if t["step"] % 2 == 0]
    odd = [t["phase_ms"]["optimizer"] for t in times if t["step"] % 2 == 1]
    micro = statistics.median(by["micro_steps"]) if by["micro_steps"] else None
    # per micro-step: the median over steps of each MICRO_PHASES sum, / micro_steps
    per_micro = {p: statistics.median(t["phase_ms"][p] for t in times) / micro_steps
                 for p in MICRO_PHASES if times and all(p in t["phase_ms"] for t in times)}
    return {"micro_steps_ms": _stats(by["micro_steps"]),
            "micro_step_ms": micro / micro_steps if micro is not None else None,
            "micro_phases_ms": per_micro,
            "optimizer_even_ms": _stats(even), "optimizer_odd_ms": _stats(odd),
            "ngram_update_ms": _stats(by["ngram_update"])}


def run_variant(args, graphs: str, runs_dir: Path) -> dict:
    cfg, index = stage_config(args, graphs, runs_dir)
    ctx = init_distributed(600, None)
    stop = GracefulStop(ctx)
    pre = preflight(cfg, ctx)
    handle = claim_run_dir(pre.run_dir, overwrite=True)
    try:
        started = time.perf_counter()
        run = prepare_run(pre.cfg, ctx, pre, stop, None, started)
        run.parts.model.set_prefix_table(run.parts.prefix_table)
        common.reset_peak(ctx.device)
        timed_run(run, 0)
        times = [t for t in step_times(run) if t["step"] < args.steps]
        if args.trace_dir is not None and run.log.profile:
            copy_file_atomic(pre.run_dir / run.log.profile["trace"], Path(args.trace_dir)
                             / f"trace_{args.stage}_{graphs}.json.gz")
        if run.progress.loader is not None:
            run.progress.loader.close()
    finally:
        handle.release()
        destroy_distributed()
    first = run.spec.untie_step + 1 if run.spec.untie_step is not None else 1
    steady = times[first:] if len(times) > first + 1 else times
    step_ms = [t["step_ms"] for t in steady]
    row = {"graphs": graphs, "stage": args.stage, "micro_steps": run.spec.micro_steps,
           "tokens_per_micro_step": run.spec.plans[0].tokens_per_rank,
           "step_ms": common.summarize(step_ms),
           "step_even_ms": _stats([t["step_ms"] for t in steady if t["step"] % 2 == 0]),
           "step_odd_ms": _stats([t["step_ms"] for t in steady if t["step"] % 2 == 1]),
           "phases_ms": phases(steady, run.spec.micro_steps),
           "host_issue_ms": common.summarize([t["host_ms"] for t in steady]),
           "host_syncs_per_step": (statistics.fmean(t["syncs"] for t in steady)
                                   if steady and steady[0]["syncs"] is not None else None),
           "warmup_s": run.log.warmup_s, "compiles": dict(run.log.compiles),
           "memory": common.memory_gib(ctx.device), "capture_report": run.parts.runner.capture_report(),
           "config_values": {key: _field(run.spec.cfg, key) for key in
                             (item.partition("=")[0] for item in args.set)},
           # what the training forward ran (the same line as the run log's): a config value
           # that did not take effect shows here, not only in a kernel list
           "strategies": describe_strategies(run.parts.model)}
    if run.log.profile:
        p = run.log.profile
        row.update(kernel_ms_per_step=p["kernel_ms"], device_busy_ms_per_step=p["device_busy_ms"],
                   gpu_busy=p["busy_fraction"],
                   kernels_per_step=p["kernels_per_step"], top_kernels=p.get("top_kernels"),
                   profile_steps=args.profile_steps)
    micro = row["phases_ms"]["micro_step_ms"]
    if micro:
        spec = common.key_specs(args.smoke)[args.stage]
        pieces = [spec.max_seq_len] * (spec.tokens // spec.max_seq_len)  # bench/model.py's shape
        f = model_bench.flops(run.spec.cfg.model, spec, pieces)
        row["mfu_micro_step"] = f["model_flops"] / (micro / 1e3) / (H200_DENSE_BF16_TFLOPS * 1e12)
    return row


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stage", default="C", choices=[s.name for s in SPEEDRUN_STAGES])
    p.add_argument("--steps", type=int, default=20, help="timed steps (even: both parities)")
    p.add_argument("--graphs", default="on,off", help="comma list of on, off")
    p.add_argument("--micro-steps", type=int, default=None, help="per step (default 8 on 1 GPU)")
    p.add_argument("--data-dir", default="data/embedded")
    p.add_argument("--profile", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--profile-steps", type=int, default=PROFILE_STEPS, metavar="N",
                   help=f"steps in the profiled window after the timed ones (1-{MAX_PROFILE_STEPS}; "
                        f"default {PROFILE_STEPS})")
    p.add_argument("--trace-dir", default=None, metavar="DIR",
                   help="keep each variant's profiler trace as DIR/trace_<stage>_<graphs>.json.gz")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="a config field, as the trainer's --set (e.g. model.fp8.enabled=true "
                        "--set model.fp8.sites=mlp_up,mlp_down); recorded in the JSON")
    p.add_argument("--model-profile", choices=tuple(config_mod.MODEL_PROFILES), default="default",
                   help="the trainer's --model-profile (e.g. record: the record's architecture), "
                        "applied before --set; recorded in the JSON")
    p.add_argument("--smoke", action="store_true", help="CPU: cpu-tiny model, eager, tiny run")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if not 1 <= args.profile_steps <= MAX_PROFILE_STEPS:
        p.error(f"--profile-steps {args.profile_steps}: needs 1 to {MAX_PROFILE_STEPS} steps (a "
                f"trace of more is too large to read)")
    try:  # a bad --set is a usage error (exit 2), before any variant runs
        base_config(args)
    except ValueError as e:
        p.error(str(e))
    if args.profile is None:
        args.profile = torch.cuda.is_available() and not args.smoke
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    setting = base_config(args).train.blas  # --set train.blas=NAME: both variants, before CUDA
    try:
        with blas.applied(setting):
            if setting != "default":
                print(blas.describe(setting), flush=True)
            return _main(args)
    except blas.BlasSettingError as e:
        print(f"step.py: error: {e}", file=sys.stderr)
        return 2


def _main(args) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    results = common.Results(Path(args.out), device, stage=args.stage, steps=args.steps,
                             micro_steps=args.micro_steps, model_profile=args.model_profile,
                             config_set=args.set, variants={}, errors={})
    with tempfile.TemporaryDirectory() as runs:
        for graphs in args.graphs.split(","):
            row = common.run_guarded(graphs, lambda g=graphs: run_variant(args, g, Path(runs)),
                                     results.data["errors"])
            if row is not None:
                results.data["variants"][graphs] = row
            results.save()
    v = results.data["variants"]
    if {"on", "off"} <= set(v):
        results.data["on_over_off"] = v["on"]["step_ms"]["median_ms"] / v["off"]["step_ms"]["median_ms"]
    results.data["complete"] = not results.data["errors"]
    results.save()
    print(json.dumps({g: {"step_ms": r["step_ms"]["median_ms"], "host_ms": r["host_issue_ms"]["median_ms"],
                          "syncs": r["host_syncs_per_step"]} for g, r in v.items()}, indent=1))
    return 0 if results.data["complete"] else 1


if __name__ == "__main__":
    sys.exit(main())
