"""Our training step against the record's at stages A and C, from one device call's raw outputs:
the record harness's timing.json (shared/anchor_modded `run.sh timing TIMING_STAGES=0,2`) and
our bench/step.py results (`--stage A` and `--stage C`, 8 micro-steps, graphs on), written as
docs/results/vs_record_<machine>_<date>.json.

What it replaces: reading two differently shaped JSON files by hand into a README table. The
stages are matched by their per-micro-step shapes: the record's stage 0 is our A (16,384 tokens
per micro-step), its stage 2 our C (49,152); a pair whose tokens or micro-steps per step differ
is refused (exit 2), as is a missing file, a file of another kind or a missing stage or variant.

Output (per stage S in --stages; "ours" from bench/step.py's graphs variant, "record" from
timing.json's stages[k]):
  command   {script, builder, record, ours: {S: command}}: every command behind the numbers
  machine   {name, ours: bench/step.py `machine` (stage A's file), record: timing.json `machine`
            (GPU, CPU, host probe: host speed differs between lent machines)}
  stages.S.{ours,record}: step_ms {median, p10, p90}, kernel_ms_per_step, phases_ms
            {fwd_bwd_per_micro_step, optimizer_even, optimizer_odd, ngram_event, extras};
            ours also mfu_fwd_bwd
  stages.S.ratio: ours / record of step_ms.median and of kernel_ms_per_step (null where a side
            has none)

Field mapping (source field -> output field); every time is in ms:
  step_ms         ours:   variants[g].step_ms.{median_ms,p10_ms,p90_ms} (CUDA events at the
                          start and end of each timed step, trainer/timing.StepTimer; the first
                          timed step is left out)
                  record: stages[k].steady.step_ms.{median,p10,p90} (CUDA events at the step's
                          first and last phase mark; steady.period_ms, start to next start, is
                          the harness's headline and differs from it by the few microseconds
                          between steps)
  kernel_ms_per_step
                  ours:   variants[g].kernel_ms_per_step (torch.profiler, 2 steps after the timed
                          ones; absent with --no-profile -> null)
                  record: stages[k].profiled.kernel_ms_per_step (PROFILE_STEPS=2 steps after the
                          window; null when the run had PROFILE_STEPS=0 or predates the knob)
  fwd_bwd_per_micro_step
                  ours:   phases_ms.micro_phases_ms forward + backward (the steady window's
                          CUDA-event phases per micro-step: forward replay; row-id exchange,
                          backward replay and gradient handoff) when the result has them; older
                          results: the capture_report row of the stage's key (key.tokens ==
                          tokens_per_micro_step): replay_ms, forward + backward replay timed once
                          on the warmup's self-check visit (graphs on only: with graphs off there
                          is no replay and this is null)
                  record: stages[k].steady.fwd_bwd_ms.median (fwd + bwd phase per micro-step,
                          from CUDA events in the steady window)
  optimizer_even / optimizer_odd
                  ours:   variants[g].phases_ms.optimizer_{even,odd}_ms.median_ms
                  record: stages[k].steady.opt_{even,odd}_ms.median (odd steps are Adam steps
                          on both sides)
  ngram_event     ours:   variants[g].phases_ms.ngram_update_ms.median_ms (per event step: the
                          n-gram table applies its held gradients every second step)
                  record: null: the record has no such phase; its bigram embedding is an Adam
                          parameter updated inside the odd optimizer step
                          (steady.optimizer_parts_ms.odd.bigram_embed)
  extras          ours:   phases_ms.micro_steps_ms.median_ms - micro_steps x fwd_bwd_per_micro_step:
                          the micro-step loop's time besides forward + backward (loader copies,
                          n-gram row exchange, gradient hold); null without a replay time
                  record: micro_steps x steady.data_ms.median + steady.quant_ms.median: the
                          data phase of each micro-step (loader send + sparse index update) and
                          the FP8 re-quantisation after the optimizer
  mfu_fwd_bwd     ours:   variants[g].mfu_micro_step x phases_ms.micro_step_ms / replay_ms (the
                          same model FLOPs, bench/model.py's formula at 790 TFLOP/s, over the
                          forward + backward replay instead of the whole micro-step)

Run (from the repo root; scripts/gpu/vs_record.sh does this on the device):
  PYTHONPATH=. python bench/vs_record.py --record OUT/anchor/timing.json \\
      --ours OUT/step_A.json --ours OUT/step_C.json --machine h200 --out-dir docs/results
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.results_io import (InputError, StepBench, add_output_args, builder_command, dig,
                              load_record_timing, load_step_benches, parse_stages, ratio, run_main,
                              spread, today, write_result)

RECORD_STAGE = {"A": "0", "C": "2"}  # our stage -> the record's TRAINING_STAGES index (same shapes)


def ours_side(bench: StepBench, graphs: str) -> tuple[dict, int, int]:
    """Our numbers for one stage; returns (side, tokens per micro-step, micro-steps)."""
    row = bench.row(graphs)
    phases, micro = row.get("phases_ms") or {}, row.get("micro_steps")
    tokens = row.get("tokens_per_micro_step")
    # the steady forward + backward per micro-step (the timer's phases) when the bench has them,
    # else the one replay timed at warmup (the capture report; results before the phases)
    per_micro = phases.get("micro_phases_ms") or {}
    replay = (per_micro["forward"] + per_micro["backward"]
              if "forward" in per_micro and "backward" in per_micro else
              next((r.get("replay_ms") for r in row.get("capture_report") or []
                    if dig(r, "key", "tokens") == tokens), None))
    micro_steps_ms = dig(phases, "micro_steps_ms", "median_ms")
    extras = micro_steps_ms - micro * replay if micro_steps_ms is not None and replay else None
    mfu = (row["mfu_micro_step"] * phases["micro_step_ms"] / replay
           if replay and row.get("mfu_micro_step") and phases.get("micro_step_ms") else None)
    side = {"step_ms": spread(row.get("step_ms"), "_ms"),
            "kernel_ms_per_step": row.get("kernel_ms_per_step"),
            "phases_ms": {"fwd_bwd_per_micro_step": replay,
                          "optimizer_even": dig(phases, "optimizer_even_ms", "median_ms"),
                          "optimizer_odd": dig(phases, "optimizer_odd_ms", "median_ms"),
                          "ngram_event": dig(phases, "ngram_update_ms", "median_ms"),
                          "extras": extras},
            "mfu_fwd_bwd": mfu}
    return side, tokens, micro


def record_side(stage: dict) -> tuple[dict, int, int]:
    """The record's numbers for one stage; returns (side, tokens per micro-step, micro-steps)."""
    steady, micro = stage.get("steady") or {}, stage.get("micro_steps_per_step")
    data, quant = dig(steady, "data_ms", "median"), dig(steady, "quant_ms", "median")
    side = {"step_ms": spread(steady.get("step_ms"), ""),
            "kernel_ms_per_step": dig(stage, "profiled", "kernel_ms_per_step"),
            "phases_ms": {"fwd_bwd_per_micro_step": dig(steady, "fwd_bwd_ms", "median"),
                          "optimizer_even": dig(steady, "opt_even_ms", "median"),
                          "optimizer_odd": dig(steady, "opt_odd_ms", "median"),
                          "ngram_event": None,
                          "extras": micro * data + quant if None not in (micro, data, quant) else None}}
    return side, stage.get("tokens_per_micro_step"), micro


def build(record_path: Path, ours_paths: list[Path], stages: list[str], graphs: str,
          machine: str, script: str | None) -> dict:
    record = load_record_timing(record_path)
    benches = load_step_benches(ours_paths)
    result = {"command": {"script": script, "builder": builder_command(),
                          "record": dig(record, "run", "command"), "ours": {}},
              "machine": {"name": machine, "ours": None, "record": record.get("machine")},
              "stages": {}}
    for stage in stages:
        if stage not in benches:
            raise InputError(f"--ours: no bench/step.py result for stage {stage} among "
                             f"{[str(p) for p in ours_paths]}; run bench/step.py --stage {stage}")
        k = RECORD_STAGE[stage]
        if k not in record["stages"]:
            raise InputError(f"{record_path}: no stage {k} (our {stage}); it holds "
                             f"{sorted(record['stages'])}: the run was cut or had other "
                             f"TIMING_STAGES (pass --stages to build the others)")
        ours, ours_tokens, ours_micro = ours_side(benches[stage], graphs)
        rec, rec_tokens, rec_micro = record_side(record["stages"][k])
        if (ours_tokens, ours_micro) != (rec_tokens, rec_micro):
            raise InputError(f"stage {stage}: {benches[stage].path} has {ours_tokens} tokens x "
                             f"{ours_micro} micro-steps, {record_path} stage {k} {rec_tokens} x "
                             f"{rec_micro}: not the same step (run bench/step.py with --micro-steps "
                             f"{rec_micro})")
        result["command"]["ours"][stage] = benches[stage].command
        result["machine"]["ours"] = result["machine"]["ours"] or benches[stage].machine
        result["stages"][stage] = {
            "ours": ours, "record": rec,
            "ratio": {"step_ms_median": ratio(dig(ours, "step_ms", "median"), dig(rec, "step_ms", "median")),
                      "kernel_ms_per_step": ratio(ours["kernel_ms_per_step"], rec["kernel_ms_per_step"])}}
    return result


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/vs_record.py", description=__doc__.split("\n")[0])
    p.add_argument("--record", type=Path, required=True, metavar="TIMING_JSON",
                   help="the record harness's timing.json (run.sh timing TIMING_STAGES=0,2)")
    p.add_argument("--ours", type=Path, action="append", required=True, metavar="STEP_JSON",
                   help="a bench/step.py result, once per stage")
    p.add_argument("--graphs", default="on", choices=("on", "off"), help="our variant (default on)")
    add_output_args(p, stages="A,C")
    args = p.parse_args(argv)
    args.stages = parse_stages(p, args.stages, RECORD_STAGE, " (the record harness times its "
                               "stages 0 and 2 as ours A and C)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    result = build(args.record, args.ours, args.stages, args.graphs, args.machine, args.script)
    # one stage per device call (a cold record compiles each stage for minutes): its name says so
    part = "" if sorted(args.stages) == sorted(RECORD_STAGE) else "_" + "".join(args.stages)
    write_result(args.out_dir, f"vs_record_{args.machine}_{args.date or today()}{part}.json", result)
    for stage, s in result["stages"].items():
        print(f"stage {stage}: ours / record step {s['ratio']['step_ms_median']}, "
              f"kernel {s['ratio']['kernel_ms_per_step']}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main("bench/vs_record.py", main, None))
