"""Run outputs: metrics as JSON lines, the run summary, and PNG plots, under runs/<run_id>/.

What it replaces: the speedrun's print-to-log lines, which a reader has to grep. Here every
training and validation event is one JSON object per line (`metrics.jsonl`), the end of a run
writes `summary.json` (temp file + rename), and `plot_run` draws loss vs step and vs time and the
per-stage ms/step; `plot_compare` puts two runs (graphs on vs off) side by side.

Only rank 0 writes. Nothing here touches the GPU; the trainer passes plain numbers.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

H200_DENSE_BF16_TFLOPS = 790.0  # measured on this workplace's H200s (8192^3 bf16 matmul)


def write_json_atomic(path: Path, obj) -> None:
    """Write JSON to a temp file and rename it: readers never see a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1, default=str) + "\n")
    os.replace(tmp, path)


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


def stage_ms_per_step(step_times: list[dict]) -> dict[str, dict]:
    """Median/mean/min/max ms per step for each stage, from [{"stage", "step_ms"}] of timed steps."""
    import statistics

    by_stage: dict[str, list[float]] = {}
    for r in step_times:
        by_stage.setdefault(r["stage"], []).append(r["step_ms"])
    out = {}
    for stage, xs in by_stage.items():
        steady = xs[1:] if len(xs) > 2 else xs  # a stage's first step carries its YaRN switch
        out[stage] = {"steps": len(xs), "median_ms": statistics.median(steady),
                      "mean_ms": statistics.fmean(steady), "min_ms": min(steady), "max_ms": max(steady)}
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
