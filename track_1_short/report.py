"""Run outputs: metrics as JSON lines, the run summary, and PNG plots, under runs/<run_id>/.

What it replaces: the speedrun's print-to-log lines, which a reader has to grep. Here every
training and validation event is one JSON object per line (`metrics.jsonl`), the end of a run
writes `summary.json` (temp file + rename), and `plot_run` draws loss vs step and vs time and the
per-stage ms/step; `plot_compare` puts two runs (graphs on vs off) side by side, and
`plot_val_compare` overlays their validation curves, with the record's (`read_record_val_curve`:
the loss.jsonl of shared/anchor_modded's `run.sh loss`) when one is given.

Only rank 0 writes. Nothing here touches the GPU; the trainer passes plain numbers.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from track_1_short.atomic_io import write_json_atomic
from track_1_short.constants import H200_DENSE_BF16_TFLOPS


def git_revision(repo: Path | None = None) -> str:
    """The checkout's commit (with '-dirty' when it has changes), or 'unknown' outside git."""
    repo = repo or Path(__file__).resolve().parents[1]
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (rev + ("-dirty" if dirty else "")) or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def git_tree(repo: Path | None = None) -> str:
    """The git tree hash of the checkout's files as they are (tracked and untracked, not ignored).

    It names the code that ran even where the checkout's .git is older than its files (a copied
    working tree): it equals `git rev-parse <commit>^{tree}` of the commit holding those files. The
    checkout's own index is left alone (a temporary index is used). 'unknown' outside git.
    """
    repo = repo or Path(__file__).resolve().parents[1]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            env = os.environ | {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
            for args in (["add", "-A", "."], ["write-tree"]):
                out = subprocess.run(["git", *args], cwd=repo, env=env, capture_output=True,
                                     text=True, timeout=60)
                if out.returncode != 0:
                    return "unknown"
            return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def code_identity() -> dict[str, str]:
    """What every results file says about the code that wrote it: the commit and the files' tree."""
    return {"git_revision": git_revision(), "git_tree": git_tree()}


@dataclass(slots=True)
class MetricsLog:
    """Append-only `metrics.jsonl` of one run (rank 0 only; other ranks get enabled=False)."""

    run_dir: Path
    enabled: bool = True
    records: list[dict] = field(default_factory=list)

    def __post_init__(self):
        if self.enabled:
            self.run_dir.mkdir(parents=True, exist_ok=True)

    def log(self, **record) -> None:
        self.records.append(record)
        if self.enabled:
            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record, default=str) + "\n")

    @staticmethod
    def read(run_dir: Path) -> list[dict]:
        path = Path(run_dir) / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _by_stage(step_times: list[dict], field: str, default=None) -> dict[str, list]:
    """{stage: [row[field] of its timed steps, in order]} (`default` for a row without it)."""
    out: dict[str, list] = {}
    for r in step_times:
        value = r.get(field)
        out.setdefault(r["stage"], []).append(default if value is None else value)
    return out


def _quantile(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=10, method="inclusive")[round(q * 10) - 1] if len(xs) > 1 else xs[0]


def stage_ms_per_step(step_times: list[dict], field: str = "step_ms") -> dict[str, dict]:
    """Median/mean/min/max/p10/p90 ms per step for each stage, from [{"stage", field}] of timed
    steps (field "step_ms": the device's step time; "host_ms": the host's time to issue it)."""
    out = {}
    for stage, xs in _by_stage(step_times, field).items():
        steady = xs[1:] if len(xs) > 2 else xs  # a stage's first step carries its YaRN switch
        out[stage] = {"steps": len(xs), "median_ms": statistics.median(steady),
                      "mean_ms": statistics.fmean(steady), "min_ms": min(steady), "max_ms": max(steady),
                      "p10_ms": _quantile(steady, 0.1), "p90_ms": _quantile(steady, 0.9)}
    return out


def stage_syncs_per_step(step_times: list[dict]) -> dict[str, dict]:
    """Host syncs inside a timed step (trainer/timing.SyncCounter), per stage: mean and max; empty
    where none were counted (CPU runs)."""
    out = {}
    for stage, xs in _by_stage(step_times, "syncs").items():
        counted = [x for x in xs if x is not None]
        if counted:
            out[stage] = {"steps": len(counted), "mean": statistics.fmean(counted), "max": max(counted)}
    return out


def stage_phase_ms(step_times: list[dict]) -> dict[str, dict]:
    """Where a step's time goes, per stage: {stage: {phase: {steps, median_ms, mean_ms,
    mean_ms_per_step}}} from the "phase_ms" of each timed step (train.StepTimer). A phase that runs
    on some steps only (the n-gram update event) has its median and mean over the steps it ran,
    and mean_ms_per_step = its total / the stage's steps (what it adds to an average step)."""
    out = {}
    for stage, rows in _by_stage(step_times, "phase_ms", {}).items():
        phases: dict[str, list[float]] = {}
        for row in rows:
            for phase, ms in row.items():
                phases.setdefault(phase, []).append(ms)
        out[stage] = {phase: {"steps": len(xs), "median_ms": statistics.median(xs),
                              "mean_ms": statistics.fmean(xs),
                              "mean_ms_per_step": sum(xs) / len(rows)}
                      for phase, xs in phases.items()}
    return out


def mfu(flops_per_step: float, step_ms: float, num_gpus: int,
        peak_tflops: float = H200_DENSE_BF16_TFLOPS) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over num_gpus x peak dense bf16."""
    return flops_per_step / (step_ms * 1e-3) / (num_gpus * peak_tflops * 1e12)


def plot_run(run_dir: Path, records: list[dict] | None = None,
             step_times: list[dict] | None = None) -> list[Path]:
    """loss_vs_step.png, loss_vs_time.png and ms_per_step.png of one run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = records if records is not None else MetricsLog.read(run_dir)
    train = [r for r in records if r.get("kind") == "train"]
    val = [r for r in records if r.get("kind") == "val"]
    paths = []
    for x_key, x_label, name in (("step", "step", "loss_vs_step.png"),
                                 ("train_time_s", "training time (s)", "loss_vs_time.png")):
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([r[x_key] for r in train], [r["loss"] for r in train], lw=0.8,
                label="train objective (CE + MTP + prefix)")
        if val:
            ax.plot([r[x_key] for r in val], [r["val_loss"] for r in val], "o-", label="val loss")
        ax.set_xlabel(x_label)
        ax.set_ylabel("loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(run_dir / name, dpi=110)
        plt.close(fig)
        paths.append(run_dir / name)
    stages = stage_ms_per_step(step_times or [])
    if stages:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.bar(list(stages), [s["median_ms"] for s in stages.values()])
        ax.set_ylabel("median ms / step")
        ax.set_xlabel("stage")
        fig.tight_layout()
        fig.savefig(run_dir / "ms_per_step.png", dpi=110)
        plt.close(fig)
        paths.append(run_dir / "ms_per_step.png")
    return paths


def plot_compare(summaries: dict[str, dict], out: Path) -> Path:
    """Per-stage median ms/step of several runs side by side (e.g. graphs on vs off)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    stages = sorted({s for summ in summaries.values() for s in summ["ms_per_step_by_stage"]})
    width = 0.8 / max(1, len(summaries))
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (label, summ) in enumerate(summaries.items()):
        ys = [summ["ms_per_step_by_stage"].get(s, {}).get("median_ms", 0.0) for s in stages]
        ax.bar(np.arange(len(stages)) + i * width, ys, width, label=label)
    ax.set_xticks(np.arange(len(stages)) + width * (len(summaries) - 1) / 2, stages)
    ax.set_ylabel("median ms / step")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


RECORD_KINDS = ("warmup", "train", "val")  # the `kind` of every loss.jsonl line of the harness


def read_record_val_curve(path: Path) -> dict:
    """The record's validation curve from the loss.jsonl of the record's harness
    (shared/anchor_modded, `run.sh loss`: one JSON object per line, `kind` warmup, train or val;
    a val line has step, val_loss and train_time_ms). `path`: that file or the folder holding it.
    Returns {"source", "val_curve": [{"step", "val_loss", "train_time_s"}], "final_val_loss"}.
    ValueError names the file and what it holds instead (our own metrics.jsonl, another format,
    no validation yet)."""
    path = Path(path)
    if path.is_dir():
        path = path / "loss.jsonl"
    if not path.is_file():
        raise ValueError(f"{path} does not exist: pass the loss.jsonl that the harness's "
                         "`run.sh loss` writes into its OUT_DIR (or that folder)")
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {number}: not JSON ({e.msg}): not a loss.jsonl") from None
    val = [r for r in records if isinstance(r, dict) and r.get("kind") == "val"]
    if val and all("train_time_s" in r and "train_time_ms" not in r for r in val):
        raise ValueError(f"{path} is a track_1_short metrics.jsonl, not the record's loss.jsonl: "
                         "pass its run dir with --run LABEL=RUN_DIR")
    if not any(isinstance(r, dict) and r.get("kind") in RECORD_KINDS for r in records):
        raise ValueError(f"{path} has no line of kind {RECORD_KINDS}: not the harness's loss.jsonl")
    if not val:
        raise ValueError(f"{path} has no validation line (kind 'val'): the run stopped before its "
                         "first validation; see its loss.log")
    curve = [{"step": int(r["step"]), "val_loss": float(r["val_loss"]),
              "train_time_s": r["train_time_ms"] / 1e3 if r.get("train_time_ms") is not None else None}
             for r in val]
    return {"source": str(path), "val_curve": curve, "final_val_loss": curve[-1]["val_loss"]}


def plot_val_compare(curves: dict[str, list[dict]], out: Path, record: dict | None = None) -> Path:
    """Validation loss vs step of several runs ({label: val_curve}) in one plot, the record's
    curve (read_record_val_curve) dashed beside them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, curve in curves.items():
        ax.plot([r["step"] for r in curve], [r["val_loss"] for r in curve], "o-", ms=3, label=label)
    if record is not None:
        ax.plot([r["step"] for r in record["val_curve"]], [r["val_loss"] for r in record["val_curve"]],
                "s--", ms=3, color="black", label="record (modded-nanogpt)")
    ax.set_xlabel("step")
    ax.set_ylabel("val loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def compare_runs(runs: dict[str, Path], out_dir: Path, record: Path | None = None) -> dict:
    """Side-by-side summary of runs of one preset (e.g. graphs off vs on, run back to back):
    writes `compare.json` and `ms_per_step_compare.png` under out_dir and returns the JSON.

    The first run is the baseline: for every other run, the timed-run difference (seconds and
    ratio) and, per stage, the median ms/step difference and ratio. Per run: train time, wall and
    warmup seconds, tokens/s per GPU, peak memory, final val loss, compiles, graphs mode and git
    revision, copied from its summary.json. Runs of different presets, world sizes or step counts
    are not comparable: ValueError naming the field and both values.

    `record`: the record's loss.jsonl (read_record_val_curve); its val curve goes into the JSON
    (`record`) and into `val_loss_compare.png` beside every run's, and one run is then enough.
    That plot is written whenever a run has a val curve or a record is given."""
    if len(runs) + (record is not None) < 2:
        raise ValueError(f"compare_runs: needs at least two runs, or one run and a record curve, "
                         f"got runs {list(runs)}")
    record_curve = read_record_val_curve(record) if record is not None else None
    summaries = {}
    for label, run_dir in runs.items():
        path = Path(run_dir) / "summary.json"
        if not path.is_file():
            raise ValueError(f"compare_runs: {path} does not exist (run {label!r} did not finish, "
                             "or the path is not a run directory)")
        summaries[label] = json.loads(path.read_text())
        missing = [k for k in ("preset", "train_time_s", "ms_per_step_by_stage")
                   if k not in summaries[label]]
        if missing:
            raise ValueError(f"compare_runs: {path} has no {missing} (not a trainer summary, or "
                             "one from an older trainer)")
    (base_label, base), *others = summaries.items()
    for field_name in ("preset", "world_size", "micro_steps", "steps", "start_step"):
        for label, s in others:
            if s.get(field_name) != base.get(field_name):
                raise ValueError(f"compare_runs: {field_name} differs: {base_label}="
                                 f"{base.get(field_name)!r}, {label}={s.get(field_name)!r}")
    keep = ("graphs", "git_revision", "device", "train_time_s", "wall_s", "warmup_s",
            "tokens_per_s_per_gpu", "peak_memory_gib", "final_val_loss", "compiles")
    result = {"preset": base["preset"], "world_size": base["world_size"], "steps": base["steps"],
              "baseline": base_label,
              "runs": {label: {k: s.get(k) for k in keep} | {"run_dir": str(runs[label])}
                       for label, s in summaries.items()},
              "ms_per_step_by_stage": {label: {st: v["median_ms"] for st, v in
                                               s["ms_per_step_by_stage"].items()}
                                       for label, s in summaries.items()},
              "versus_baseline": {}}
    for label, s in others:
        stages = {}
        for st, v in base["ms_per_step_by_stage"].items():
            if st in s["ms_per_step_by_stage"]:
                m = s["ms_per_step_by_stage"][st]["median_ms"]
                stages[st] = {"median_ms_diff": m - v["median_ms"], "ratio": m / v["median_ms"]}
        result["versus_baseline"][label] = {
            "train_time_s_diff": s["train_time_s"] - base["train_time_s"],
            "train_time_ratio": s["train_time_s"] / base["train_time_s"],
            "stages": stages,
            # stages timed in only one of the two runs (not compared)
            "stages_unmatched": sorted(set(base["ms_per_step_by_stage"]) ^ set(s["ms_per_step_by_stage"]))}
    if record_curve is not None:
        result["record"] = record_curve
    out_dir = Path(out_dir)
    write_json_atomic(out_dir / "compare.json", result)
    plot_compare(summaries, out_dir / "ms_per_step_compare.png")
    curves = {label: s["val_curve"] for label, s in summaries.items() if s.get("val_curve")}
    if curves or record_curve is not None:
        plot_val_compare(curves, out_dir / "val_loss_compare.png", record_curve)
    return result


def main(argv: list[str] | None = None) -> int:
    """`python -m track_1_short.report compare --run off=runs/a --run on=runs/b --out DIR`
    (`--record PATH/loss.jsonl` adds the record's val curve)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m track_1_short.report",
                                description="compare run summaries side by side")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compare", help="compare.json + ms_per_step_compare.png of two or more runs")
    c.add_argument("--run", action="append", required=True, metavar="LABEL=RUN_DIR",
                   help="a run directory with summary.json; the first --run is the baseline")
    c.add_argument("--record", type=Path, metavar="LOSS_JSONL",
                   help="the record's loss.jsonl (shared/anchor_modded `run.sh loss`, or its OUT_DIR): "
                        "its val curve joins val_loss_compare.png and compare.json; one --run is "
                        "then enough")
    c.add_argument("--out", type=Path, required=True, help="directory for the comparison files")
    args = p.parse_args(argv)
    runs = {}
    for spec in args.run:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path:
            p.error(f"--run {spec!r}: expected LABEL=RUN_DIR, e.g. --run off=runs/small-gpu-off")
        if label in runs:
            p.error(f"--run {spec!r}: label {label!r} given twice")
        runs[label] = Path(path)
    try:
        result = compare_runs(runs, args.out, args.record)
    except ValueError as e:
        p.error(str(e))
    for label, v in result["versus_baseline"].items():
        print(f"{label} vs {result['baseline']}: train time {v['train_time_ratio']:.4f}x "
              f"({v['train_time_s_diff']:+.2f} s); per stage "
              + ", ".join(f"{st} {d['ratio']:.4f}x" for st, d in v["stages"].items()))
    if "record" in result:
        rec = result["record"]
        print(f"record ({rec['source']}): {len(rec['val_curve'])} validations, final val loss "
              f"{rec['final_val_loss']:.4f}")
    print(f"wrote {Path(args.out) / 'compare.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
