"""Row prefetch benchmark: time of the n-gram row-id all_to_all per micro-step, and how much of it
hides under concurrent compute on the compute stream; plus the row payload exchange (not hidden).

What it measures (DESIGN section 2, "row_prefetch"): per micro-step, the trainer's order is
forward replay -> RowPrefetch.issue (phase A: next batch's ids, unique, count + id all_to_all on a
side stream) -> backward replay -> ... -> slots_for (phase B: row payload all_to_all). Here the
replays are stood in for by bf16 matmuls on the compute stream (--fwd-matmuls, --bwd-matmuls of
--matmul-size^2), the table is the speedrun's (754,560 x 768 rows fp32, sharded over the ranks) and
the batch is --tokens random tokens with BOS-led documents. CUDA events on both streams give:
id_exchange_ms (side stream, issue start -> ids received), hidden_ms (its overlap with the compute
stream's busy interval), row_exchange_ms (phase B on the compute stream) and issue_host_ms (the host
time issue() blocks: the count sync). Medians over --steps after --warmup.

Run (2 H200s): `torchrun --nproc_per_node 2 bench/row_prefetch.py` -> docs/results/
row_prefetch_cuda_w2.json with its command. `--smoke`: 2 gloo processes on CPU, tiny shapes,
host timers (hidden_ms is null), for the CPU test.
Legend: T tokens per micro-batch.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from bench.common import command  # noqa: E402
from track_1_short.atomic_io import write_json_atomic  # noqa: E402
from track_1_short.model.tokens import BOS_ID  # noqa: E402
from track_1_short.distributed import destroy_distributed, init_distributed  # noqa: E402
from track_1_short.model.ngram_config import NgramConfig  # noqa: E402
from track_1_short.model.ngram_lookup import NgramLookup  # noqa: E402
from track_1_short.perf.ngram_store import NgramStore  # noqa: E402
from track_1_short.perf.row_prefetch import LookaheadLoader, RowPrefetch  # noqa: E402


class _Batch:
    def __init__(self, inputs):
        self.inputs = inputs  # int32 [T]


class _SyntheticLoader:
    """Random tokens < 50257, a BOS every ~400 tokens, pinned and copied non_blocking (as BatchLoader)."""

    def __init__(self, tokens: int, device: torch.device, seed: int):
        self.tokens, self.device = tokens, device
        self.gen = torch.Generator().manual_seed(seed)

    def next_batch(self):
        x = torch.randint(0, 50257, (self.tokens,), generator=self.gen, dtype=torch.int32)
        x[torch.randint(0, self.tokens, (max(1, self.tokens // 400),), generator=self.gen)] = BOS_ID
        x[0] = BOS_ID
        if self.device.type == "cuda":
            return _Batch(x.pin_memory().to(self.device, non_blocking=True))
        return _Batch(x)


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="2 gloo processes on CPU, tiny shapes")
    p.add_argument("--tokens", type=int, default=49_152, help="T per micro-batch (stage C: 49,152)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--matmul-size", type=int, default=8192)
    p.add_argument("--fwd-matmuls", type=int, default=2)
    p.add_argument("--bwd-matmuls", type=int, default=4)
    p.add_argument("--out", type=str, default=None, help="JSON path (default docs/results/...)")
    return p.parse_args(argv)


def _compute(a, n):
    for _ in range(n):
        a = a @ a
        a = a / a.norm()  # keep values finite
    return a


def _run(rank: int, world_size: int, args, device: torch.device) -> list[dict]:
    """warmup + steps micro-steps in the trainer's order; per-step timings (ms) after warmup."""
    sizes = dict(dim=16, bigram_rows=1024, trigram_rows=1024) if args.smoke else {}
    cfg = NgramConfig(cache_rows=2 * args.tokens, **sizes)
    table = NgramStore(NgramLookup(cfg).to(device), cycle=1, micro_steps=1)  # holds no gradient
    table.shard(rank, world_size)
    prefetch, loader = RowPrefetch(table), LookaheadLoader(_SyntheticLoader(args.tokens, device, rank))
    cuda = device.type == "cuda"
    mats = torch.randn(args.matmul_size, args.matmul_size, device=device,
                       dtype=torch.bfloat16 if cuda else torch.float32)
    rows = []
    batch = loader.next_batch()
    prefetch.slots_for(batch.inputs)  # step 0 without prefetch
    for step in range(args.warmup + args.steps):
        row = {}
        c0 = time.perf_counter()
        if cuda:
            cur = torch.cuda.current_stream(device)
            ev = {k: torch.cuda.Event(enable_timing=True) for k in ("c0", "c1", "a0", "a1", "b0", "b1")}
            ev["c0"].record(cur)
        _compute(mats, args.fwd_matmuls)
        if cuda:
            prefetch.stream = prefetch.stream or torch.cuda.Stream(device)
            ev["a0"].record(prefetch.stream)
        t0 = time.perf_counter()
        prefetch.issue(loader)  # phase A of the next micro-batch
        row["issue_host_ms"] = (time.perf_counter() - t0) * 1e3
        request = prefetch._pending[2]
        if cuda:
            with torch.cuda.stream(prefetch.stream):
                if request is not None and request.work is not None:
                    request.work.wait()
                    request.work = None
                ev["a1"].record(prefetch.stream)
        elif request is not None and request.work is not None:
            request.work.wait()
            request.work = None
        row["id_exchange_host_ms"] = (time.perf_counter() - t0) * 1e3
        _compute(mats, args.bwd_matmuls)
        if cuda:
            ev["c1"].record(cur)
            ev["b0"].record(cur)
        t1 = time.perf_counter()
        prefetch.slots_for(loader.next_batch().inputs)  # phase B (rows), on the compute stream
        if cuda:
            ev["b1"].record(cur)
            torch.cuda.synchronize(device)
            t = {k: ev["c0"].elapsed_time(e) for k, e in ev.items()}  # ms from c0
            row["id_exchange_ms"] = t["a1"] - t["a0"]
            row["hidden_ms"] = max(0.0, min(t["a1"], t["c1"]) - max(t["a0"], t["c0"]))
            row["compute_ms"] = t["c1"]
            row["row_exchange_ms"] = t["b1"] - t["b0"]
        else:
            row["id_exchange_ms"] = row["id_exchange_host_ms"]
            row["hidden_ms"] = None
            row["compute_ms"] = None
            row["row_exchange_ms"] = (time.perf_counter() - t1) * 1e3
        row["wall_ms"] = (time.perf_counter() - c0) * 1e3
        if step >= args.warmup:
            rows.append(row)
    return rows


def _median(rows, key):
    xs = [r[key] for r in rows if r[key] is not None]
    return statistics.median(xs) if xs else None


def _summary(rows, args, world_size, device) -> dict:
    out = {"command": command(),
           "world_size": world_size, "device": str(device), "tokens": args.tokens,
           "steps": args.steps, "smoke": args.smoke, "torch": torch.__version__}
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    for key in ("id_exchange_ms", "hidden_ms", "compute_ms", "row_exchange_ms", "issue_host_ms",
                "id_exchange_host_ms", "wall_ms"):
        out[key] = _median(rows, key)
    if out["hidden_ms"] is not None and out["id_exchange_ms"]:
        out["hidden_fraction"] = out["hidden_ms"] / out["id_exchange_ms"]
    out["per_step"] = rows
    return out


def _smoke_worker(rank: int, port: int, args, out: str):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    ctx = init_distributed(timeout_s=60, device_type="cpu")
    rows = _run(ctx.rank, ctx.world_size, args, ctx.device)
    if ctx.is_main:
        write_json_atomic(Path(out), _summary(rows, args, ctx.world_size, ctx.device))
    destroy_distributed()


def main(argv: list[str] | None = None) -> Path:
    args = _parse(argv)
    if args.smoke:
        args.tokens, args.steps, args.warmup, args.matmul_size = 64, 3, 1, 32
        out = Path(args.out or REPO / "build" / "row_prefetch_smoke.json")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_smoke_worker, args=(port, args, str(out)), nprocs=2)
        return out
    ctx = init_distributed(timeout_s=300)
    rows = _run(ctx.rank, ctx.world_size, args, ctx.device)
    name = f"row_prefetch_{ctx.device.type}_w{ctx.world_size}.json"
    out = Path(args.out or REPO / "docs" / "results" / name)
    if ctx.is_main:
        summary = _summary(rows, args, ctx.world_size, ctx.device)
        write_json_atomic(out, summary)
        print(json.dumps({k: v for k, v in summary.items() if k != "per_step"}, indent=1))
    destroy_distributed()
    return out


if __name__ == "__main__":
    main()
