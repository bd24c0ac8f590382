"""Inputs and outputs of the result builders bench/vs_record.py, bench/host_bound.py and
bench/loss_parity.py: the raw files a device call brings back, checked for their kind when loaded,
and the committed result JSON they become.

What it replaces: json.load and dict indexing inside each builder, where a wrong or missing file
surfaced as a KeyError traceback after the device time was spent. Here every loader checks that
the file is what the flag asks for (a bench/step.py result, the record harness's timing.json, a
trainer run dir) and raises InputError naming the file, what it holds instead and the fix;
`run_main` turns that into exit code 2 with the message on stderr.

The formats read:
- bench/step.py `--out`: {command, machine, stage, micro_steps, variants: {on|off: row}, errors,
  complete}; a row's statistics are bench/common.summarize dicts (median_ms, p10_ms, p90_ms, ...).
- shared/anchor_modded `run.sh timing` -> OUT_DIR/timing.json: {mode: "timing", machine, run:
  {command}, stages: {"0".."3": {tokens_per_micro_step, micro_steps_per_step, steady: {...},
  profiled: {...} or null}}}; its statistics are the harness's _stats dicts (median, p10, p90, ...).

Torch-free, so the builders and their tests run anywhere; nothing runs at import.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from track_1_short.atomic_io import write_json_atomic

STEP_BENCH_HINT = "pass the --out file of `PYTHONPATH=. python bench/step.py`"
TIMING_HINT = "pass OUT_DIR/timing.json of the record harness's `run.sh timing` (scripts/gpu/vs_record.sh)"


class InputError(Exception):
    """An input file or flag that cannot be used; the message names it and the fix (exit code 2)."""


def run_main(prog: str, main, argv: list[str] | None) -> int:
    """main(argv) -> its exit code; an InputError becomes `prog: error: message` on stderr and 2."""
    try:
        return main(argv)
    except InputError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


def load_json(path: Path, what: str, hint: str) -> dict:
    """The JSON object in `path`; InputError if it is missing, not JSON or not an object."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path} does not exist ({what} expected; {hint})")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise InputError(f"{path}: not JSON ({e.msg} at line {e.lineno}); {what} expected") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: a JSON {type(data).__name__}, not {what}; {hint}")
    return data


def dig(obj, *keys):
    """obj[k0][k1]... or None where a level is missing or None (a field one side does not have)."""
    for key in keys:
        if not isinstance(obj, dict) or obj.get(key) is None:
            return None
        obj = obj[key]
    return obj


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def spread(stats: dict | None, suffix: str) -> dict | None:
    """{median, p10, p90} of a statistics dict whose keys end in `suffix` ("_ms": bench/common's
    summarize, "": the record harness's _stats); None where there is none."""
    if not isinstance(stats, dict) or stats.get("median" + suffix) is None:
        return None
    return {k: stats.get(k + suffix) for k in ("median", "p10", "p90")}


@dataclass(slots=True, frozen=True)
class StepBench:
    """One bench/step.py result: one stage, one row per graphs variant that finished."""

    path: Path
    command: str | None
    machine: dict
    stage: str
    variants: dict  # {"on"|"off": row}
    errors: dict  # {"on"|"off": {"error", "traceback"}} of the variants that failed

    def row(self, graphs: str) -> dict:
        """The variant's row; InputError if it did not run or failed (its error quoted)."""
        if graphs in self.variants:
            return self.variants[graphs]
        failed = self.errors.get(graphs, {}).get("error")
        why = f"it failed: {failed}" if failed else f"ran: {sorted(self.variants) or 'none'}"
        raise InputError(f"{self.path}: no graphs={graphs} variant ({why}); re-run bench/step.py "
                         f"with --graphs {graphs} (and a longer time limit if it was cut)")


def load_step_bench(path: Path) -> StepBench:
    data = load_json(path, "a bench/step.py result", STEP_BENCH_HINT)
    if not isinstance(data.get("variants"), dict) or not isinstance(data.get("stage"), str):
        raise InputError(f"{path}: not a bench/step.py result (no 'stage' and 'variants'); "
                         f"{STEP_BENCH_HINT}")
    return StepBench(path=Path(path), command=data.get("command"), machine=data.get("machine") or {},
                     stage=data["stage"], variants=data["variants"], errors=data.get("errors") or {})


def load_step_benches(paths: list[Path]) -> dict[str, StepBench]:
    """{stage: StepBench}; InputError if two files hold the same stage."""
    out: dict[str, StepBench] = {}
    for path in paths:
        bench = load_step_bench(path)
        if bench.stage in out:
            raise InputError(f"{path} and {out[bench.stage].path} both hold stage {bench.stage}; "
                             "pass one bench/step.py result per stage")
        out[bench.stage] = bench
    return out


def load_record_timing(path: Path) -> dict:
    data = load_json(path, "the record harness's timing.json", TIMING_HINT)
    if data.get("mode") != "timing" or not isinstance(data.get("stages"), dict):
        raise InputError(f"{path}: not the record harness's timing.json (mode={data.get('mode')!r}, "
                         f"no 'stages'); {TIMING_HINT}")
    return data


def command_line(interpreter: str) -> str:
    """This process's command line as typed from the repo root (PYTHONPATH kept), run by
    `interpreter` (the one definition: bench/common.command() names the running executable)."""
    prefix = f"PYTHONPATH={os.environ['PYTHONPATH']} " if os.environ.get("PYTHONPATH") else ""
    return prefix + shlex.join([interpreter, *sys.argv])


def builder_command() -> str:
    """A builder's command line, as its docstring tells it to be run."""
    return command_line("python")


def add_output_args(p: argparse.ArgumentParser, stages: str | None = None) -> None:
    """The flags every builder shares: --date, --script, --out-dir, and with `stages` (the
    default list) --stages and --machine."""
    if stages is not None:
        p.add_argument("--stages", default=stages, help=f"stages to build (default {stages})")
        p.add_argument("--machine", default="h200", help="machine name for the file name (default h200)")
    p.add_argument("--date", default=None, help="date for the file name (default today, UTC)")
    p.add_argument("--script", default=None, help="the device script that produced the inputs")
    p.add_argument("--out-dir", type=Path, default=Path("docs/results"))


def parse_stages(p: argparse.ArgumentParser, value: str, allowed, why: str = "") -> list[str]:
    """--stages "A,C" -> ["A", "C"]; p.error (exit 2) naming the choices if one is not allowed."""
    stages = [s.strip() for s in value.split(",") if s.strip()]
    if not stages or any(s not in allowed for s in stages):
        p.error(f"--stages {','.join(stages)}: choose from {','.join(sorted(allowed))}{why}")
    return stages


def today() -> str:
    return time.strftime("%Y-%m-%d", time.gmtime())


def write_result(out_dir: Path, name: str, result: dict) -> Path:
    """result as out_dir/name (atomic: temp file + rename); returns the path."""
    path = Path(out_dir) / name
    write_json_atomic(path, result)
    print(f"wrote {path}")
    return path
