"""CPU benchmark: time to assemble one rank's packed batch, so the loader never gates a GPU step.

Measures, on one core (torch/numpy threads = 1), over the prepared corpus:
  pack_ms        TrainStream.next_slice into pinned-style host buffers + the int64 targets copy
                 (what the loader thread does per micro-batch), per stage shape
  loader_ms      BatchLoader.next_batch() end to end on the CPU device (thread + copies), per batch
Goal (foundation issue): pack_ms <= 2 ms at 49,152 tokens (stage C), against ~80 ms of GPU time per
micro-step at that shape on an H200 (facts section 8).

Run: PYTHONPATH=. python bench/loader.py --data-dir data/embedded --out docs/results/loader_cpu.json
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from track_1_short.data import SliceShape, TrainStream, list_shards, make_train_loader

SHAPES = {"A": SliceShape(16384, 896, 64), "B": SliceShape(32768, 2048, 96),
          "C": SliceShape(49152, 2048, 128)}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def time_pack(data_dir: Path, shape: SliceShape, iters: int) -> list[float]:
    stream = TrainStream(list_shards(data_dir, "train"), seed=0)
    tokens = torch.empty(shape.tokens + 1, dtype=torch.int32)
    targets = torch.empty(shape.tokens, dtype=torch.int64)
    cu = np.empty(shape.cu_seqlens_rows, dtype=np.int32)
    stream.next_slice(shape, tokens.numpy(), cu)  # loads the shard
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        stream.next_slice(shape, tokens.numpy(), cu)
        targets.copy_(tokens[1:])
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def time_loader(data_dir: Path, shape: SliceShape, iters: int) -> list[float]:
    loader = make_train_loader(data_dir, lambda step: shape, 0, 8, torch.device("cpu"), seed=0,
                               max_shape=shape)
    loader.next_batch()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        loader.next_batch()
        out.append((time.perf_counter() - t0) * 1e3)
    loader.close()
    return out


def summary(xs: list[float]) -> dict:
    q = np.percentile(xs, [10, 50, 90])
    return {"median_ms": round(statistics.median(xs), 4), "p10_ms": round(q[0], 4),
            "p90_ms": round(q[2], 4), "n": len(xs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-dir", type=Path, default=Path("data/embedded"))
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--out", type=Path, default=Path("docs/results/loader_cpu.json"))
    args = p.parse_args()
    torch.set_num_threads(1)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core
    results = {name: {"tokens": s.tokens, "pack": summary(time_pack(args.data_dir, s, args.iters)),
                      "loader_next_batch": summary(time_loader(args.data_dir, s, args.iters // 3))}
               for name, s in SHAPES.items()}
    report = {
        "benchmark": "bench/loader.py",
        "command": "PYTHONPATH=. python " + " ".join(sys.argv),
        "machine": {"cpu": cpu_model(), "cores_used": 1, "python": platform.python_version(),
                    "torch": torch.__version__, "numpy": np.__version__},
        "data_dir": str(args.data_dir),
        "goal": "pack median <= 2 ms at 49,152 tokens",
        "goal_met": results["C"]["pack"]["median_ms"] <= 2.0,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    os.replace(tmp, args.out)
    for name, r in results.items():
        print(f"{name}: {r['tokens']:6d} tokens  pack {r['pack']['median_ms']:.3f} ms  "
              f"next_batch {r['loader_next_batch']['median_ms']:.3f} ms")


if __name__ == "__main__":
    main()
