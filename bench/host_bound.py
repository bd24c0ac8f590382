"""Is one rank's step of the 8-GPU run host-bound? From bench/step.py results run with
`--micro-steps 1 --graphs on,off` at stages A and C (scripts/gpu/host_bound.sh), written as
docs/results/host_bound_<machine>_<date>.json.

What it replaces: reading step time against host issue time by hand. With one micro-step per
step (the per-rank work of 8 GPUs) the GPU has the least work per host call, so this is where
the host can be the bottleneck and where the step graphs (one replay instead of ~650 kernel
launches per micro-step at A: 5,320 per 8-micro-step step, shared/anchor_modded/RESULTS.md) should
pay: graphs on vs off per stage answers it. Refused (exit 2): a missing
file, a file of another kind, a stage or variant missing, a run with more than one micro-step.

Output, per stage S in --stages and graphs variant on/off:
  stages.S.graphs_{on,off}:
    step_ms {median, p10, p90, mean}
                                 variants[g].step_ms.{median_ms,p10_ms,p90_ms,mean_ms}: the
                                 device's time per step (CUDA events at step start and end)
    step_ms_by_parity {even, odd}
                                 variants[g].step_{even,odd}_ms.median_ms: even steps run ANVIL
                                 alone, odd ones ANVIL + Adam (a median over both parities picks
                                 one of them when the two differ; the mean weighs both)
    host_issue_ms                variants[g].host_issue_ms.median_ms: the host's time to issue a
                                 step; at or above step_ms the host is the bottleneck
    gpu_busy                     variants[g].gpu_busy: the busy share of the device's timeline in
                                 bench/step.py's torch.profiler window (--profile-steps steps,
                                 host_bound.sh: 8); null when the bench ran without --profile
    gpu_busy_timed               variants[g].device_busy_ms_per_step / step_ms.mean_ms: the
                                 window's busy device time per step over the timed steps' mean
                                 step (no profiler there). The profiler's per-launch cost slows an
                                 eager step inside its window (~600 launches at A), so gpu_busy
                                 understates graphs off; this estimate leaves that cost out. It
                                 assumes the window's steps are like the timed ones (a window of
                                 an even number of steps has both parities equally, the timed
                                 ones within one step of it); null without a profile
    host_syncs_per_step          variants[g].host_syncs_per_step (sync debug mode counts; null
                                 on CPU)
  stages.S.on_over_off: step_ms_median, step_ms_mean and host_issue_ms, graphs on / graphs off
  command {script, builder, ours: {S: command}}, machine {name, ours: the first stage's file's
  machine, by_stage: {S: that stage's file's machine}} (stages may come from different calls:
  compare graphs on with off within a stage, never stages with each other)

Run: PYTHONPATH=. python bench/host_bound.py --step OUT/host_bound_A.json \\
         --step OUT/host_bound_C.json --machine h200 --out-dir docs/results
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.results_io import (InputError, StepBench, add_output_args, builder_command, dig,
                              load_step_benches, parse_stages, ratio, run_main, spread, today,
                              write_result)

STAGES = ("A", "B", "C", "D")


def variant(bench: StepBench, graphs: str) -> dict:
    row = bench.row(graphs)
    if row.get("micro_steps") != 1:
        raise InputError(f"{bench.path}: graphs={graphs} ran {row.get('micro_steps')} micro-steps "
                         "per step; the host-bound question is asked of one rank's step of 8 GPUs: "
                         "run bench/step.py with --micro-steps 1")
    step_ms = spread(row.get("step_ms"), "_ms")
    if step_ms is not None:
        step_ms["mean"] = dig(row, "step_ms", "mean_ms")
    return {"step_ms": step_ms,
            "step_ms_by_parity": {parity: dig(row, f"step_{parity}_ms", "median_ms")
                                  for parity in ("even", "odd")},
            "host_issue_ms": dig(row, "host_issue_ms", "median_ms"),
            "gpu_busy": row.get("gpu_busy"),
            "gpu_busy_timed": ratio(row.get("device_busy_ms_per_step"), dig(row, "step_ms", "mean_ms")),
            "host_syncs_per_step": row.get("host_syncs_per_step")}


def build(paths: list[Path], stages: list[str], machine: str, script: str | None) -> dict:
    benches = load_step_benches(paths)
    result = {"command": {"script": script, "builder": builder_command(), "ours": {}},
              "machine": {"name": machine, "ours": None, "by_stage": {}}, "stages": {}}
    for stage in stages:
        if stage not in benches:
            raise InputError(f"--step: no bench/step.py result for stage {stage} among "
                             f"{[str(p) for p in paths]}; run bench/step.py --stage {stage} "
                             "--micro-steps 1 --graphs on,off")
        on, off = variant(benches[stage], "on"), variant(benches[stage], "off")
        result["command"]["ours"][stage] = benches[stage].command
        result["machine"]["ours"] = result["machine"]["ours"] or benches[stage].machine
        result["machine"]["by_stage"][stage] = benches[stage].machine
        result["stages"][stage] = {
            "graphs_on": on, "graphs_off": off,
            "on_over_off": {"step_ms_median": ratio(dig(on, "step_ms", "median"),
                                                    dig(off, "step_ms", "median")),
                            "step_ms_mean": ratio(dig(on, "step_ms", "mean"), dig(off, "step_ms", "mean")),
                            "host_issue_ms": ratio(on["host_issue_ms"], off["host_issue_ms"])}}
    return result


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/host_bound.py", description=__doc__.split("\n")[0])
    p.add_argument("--step", type=Path, action="append", required=True, metavar="STEP_JSON",
                   help="a bench/step.py result (--micro-steps 1 --graphs on,off), once per stage")
    add_output_args(p, stages="A,C")
    args = p.parse_args(argv)
    args.stages = parse_stages(p, args.stages, STAGES)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    result = build(args.step, args.stages, args.machine, args.script)
    write_result(args.out_dir, f"host_bound_{args.machine}_{args.date or today()}.json", result)
    for stage, s in result["stages"].items():
        r = s["on_over_off"]
        print(f"stage {stage}: graphs on / off step {r['step_ms_median']} (median), "
              f"{r['step_ms_mean']} (mean), host issue {r['host_issue_ms']}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main("bench/host_bound.py", main, None))
