"""Variants of our training step at one stage against a baseline variant of the same device call,
from bench/step.py results: one committed JSON with each variant's numbers and its ratio to the
baseline.

Inputs: one bench/step.py `--out` file per variant, named `step_<STAGE>_<VARIANT>.json` (as
scripts/gpu/fp8_step.sh writes them), all of one stage. A variant whose graphs variant failed (a
kernel that does not import, a cut run) is kept with its error instead of numbers, so the file says
what was tried.

Output `step_variants_<machine>_<date>_<STAGE>.json`:
  command   {script, builder, variants: {VARIANT: bench/step.py's command}}
  machine   bench/step.py's machine block of the first file
  stage, baseline
  variants  {VARIANT: {step_ms {median, p10, p90}, kernel_ms_per_step, phases_ms
            {fwd_bwd_per_micro_step, optimizer_even, optimizer_odd, ngram_event, extras},
            mfu_fwd_bwd, strategies (what the training forward ran), ratio_to_baseline
            {step_ms_median, kernel_ms_per_step}} or
            {error}}; the fields as in bench/vs_record.py's "ours" side (one definition:
            vs_record.ours_side)

Run (from the repo root; scripts/gpu/fp8_step.sh does this on the device):
  PYTHONPATH=. python bench/step_variants.py OUT/step_C_bf16.json OUT/step_C_fa4.json \\
      --baseline bf16 --out-dir docs/results
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from bench.results_io import (InputError, add_output_args, builder_command, dig, load_step_bench,
                              ratio, run_main, today, write_result)
from bench.vs_record import ours_side

NAME = re.compile(r"step_(?P<stage>[A-Z]\w*?)_(?P<variant>\w+)\.json$")


def build(paths: list[Path], baseline: str, graphs: str, script: str | None) -> dict:
    benches = {}
    for path in paths:
        m = NAME.search(Path(path).name)
        if m is None:
            raise InputError(f"{path}: name it step_<STAGE>_<VARIANT>.json (as scripts/gpu/"
                             "fp8_step.sh does): the variant's name comes from the file name")
        bench = load_step_bench(path)
        if m["stage"] != bench.stage:
            raise InputError(f"{path}: the name says stage {m['stage']}, the file holds stage "
                             f"{bench.stage}")
        if m["variant"] in benches:
            raise InputError(f"{path}: variant {m['variant']} given twice")
        benches[m["variant"]] = bench
    stages = {b.stage for b in benches.values()}
    if len(stages) != 1:
        raise InputError(f"the files hold stages {sorted(stages)}: pass one stage's variants")
    if baseline not in benches:
        raise InputError(f"--baseline {baseline}: no step_*_{baseline}.json among "
                         f"{[str(p) for p in paths]}")
    sides: dict[str, dict] = {}
    for name, bench in benches.items():
        try:
            sides[name], _, _ = ours_side(bench, graphs)
            # what the forward ran (bench/step.py's line; absent in files before 2026-12-02)
            sides[name]["strategies"] = bench.row(graphs).get("strategies")
        except InputError as e:  # the variant failed or was cut: say so, keep the others
            sides[name] = {"error": str(e)}
    base = sides[baseline]
    if "error" in base:
        raise InputError(f"--baseline {baseline}: {base['error']}")
    for name, side in sides.items():
        if "error" not in side:
            side["ratio_to_baseline"] = {
                "step_ms_median": ratio(dig(side, "step_ms", "median"), dig(base, "step_ms", "median")),
                "kernel_ms_per_step": ratio(side["kernel_ms_per_step"], base["kernel_ms_per_step"])}
    first = next(iter(benches.values()))
    return {"command": {"script": script, "builder": builder_command(),
                        "variants": {n: b.command for n, b in benches.items()}},
            "machine": first.machine, "stage": first.stage, "baseline": baseline,
            "variants": sides}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/step_variants.py", description=__doc__.split("\n")[0])
    p.add_argument("steps", type=Path, nargs="+", metavar="STEP_JSON",
                   help="bench/step.py results named step_<STAGE>_<VARIANT>.json")
    p.add_argument("--baseline", default="bf16", help="the variant the others are divided by (default bf16)")
    p.add_argument("--graphs", default="on", choices=("on", "off"), help="bench/step.py's variant (default on)")
    p.add_argument("--machine", default="h200", help="machine name for the file name (default h200)")
    add_output_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    result = build(args.steps, args.baseline, args.graphs, args.script)
    write_result(args.out_dir, f"step_variants_{args.machine}_{args.date or today()}_{result['stage']}.json",
                 result)
    for name, side in result["variants"].items():
        if "error" in side:
            print(f"{name}: {side['error']}")
        else:
            print(f"{name}: step {dig(side, 'step_ms', 'median'):.1f} ms "
                  f"({side['ratio_to_baseline']['step_ms_median']:.3f}x {args.baseline}), kernel "
                  f"{side['kernel_ms_per_step'] or float('nan'):.1f} ms, forward+backward per "
                  f"micro-step {side['phases_ms']['fwd_bwd_per_micro_step'] or float('nan'):.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(run_main("bench/step_variants.py", main, None))
