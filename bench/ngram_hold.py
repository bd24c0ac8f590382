"""The n-gram work of one micro-step outside the step graphs, op by op, at a stage's shapes on
real tokens: where the ~7.3 ms per micro-step at stage C that is not the forward/backward replay
goes (docs/results/README.md, 2026-12-01, fifth lease).

What it measures (one process, one GPU, CUDA events, median of --steps calls each): on the first
T tokens x 8 micro-batches of a training shard, with the speedrun's NgramConfig (754,560 rows x
768, float32):
- row_ids          NgramLookup.row_ids(inputs): the hashing, [T] -> [2T]
- slots_for        NgramStore.slots_for: the table gather into the row cache (+ the slots)
- hold             NgramStore.hold: index_add_ of the [2T, 768] sink gradient into the row
                   accumulator + index_fill_ of the touched flags (what the trainer runs)
- index_add        the accumulation alone;  index_fill  the flags alone
- index_put_accumulate   the same accumulation through index_put_(accumulate=True) (sort-based)
- index_add_sorted       index_add_ with the ids pre-sorted (fewer atomics in flight per row)
- row_accumulate         kernels/row_accumulate.py (a stable sort of the ids, one add per distinct
                         row, no atomics; CUDA only), and hold_sorted: the hold through it
                         (NgramStore(accumulate="sorted"), train.ngram_accumulate=sorted)
- row_accumulate_vector  the same module's vector-atomic kernel (index_add_'s sum, four columns
                         per float32 atomic; CUDA only), and hold_vector_atomic: the hold through it
                         (train.ngram_accumulate=vector_atomic)
- copy             a plain copy of one [2T, 768] float32 tensor (the memory-bound reference)
and the row statistics of the micro-batch (distinct rows, the most repeated row's count).
Run (H200): PYTHONPATH=. python bench/ngram_hold.py --stage C --out docs/results/ngram_hold_h200_C.json
Smoke (CPU, tiny table, synthetic tokens): PYTHONPATH=. python bench/ngram_hold.py --smoke --out /tmp/h.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

from bench import common
from bench.common import UsageError, measure_and_write
from track_1_short.data import DataError, list_shards, read_shard
from track_1_short.model.ngram_config import NgramConfig
from track_1_short.model.ngram_lookup import NgramLookup
from track_1_short.perf.ngram_store import NgramStore
from track_1_short.schedule import SPEEDRUN_STAGES

MICRO_BATCHES = 8


def tokens(args, count: int) -> np.ndarray:
    """The first `count` tokens of the first training shard (synthetic ids with --smoke)."""
    if args.smoke:
        return np.random.default_rng(0).integers(0, 500, count).astype(np.int32)
    try:
        shards = list_shards(Path(args.data_dir), "train")
        tok = read_shard(shards[0]).numpy()[:count]  # validated: header, size, token range
    except DataError as e:
        raise UsageError(f"--data-dir: {e}") from None
    if tok.size < count:
        raise UsageError(f"--data-dir: {shards[0]} holds {tok.size} tokens < the {count} needed; "
                         f"use a larger corpus")
    return tok.astype(np.int32)


def measure(args) -> dict:
    device = torch.device("cpu" if args.smoke else "cuda")
    T = 64 if args.smoke else next(s.tokens_per_rank for s in SPEEDRUN_STAGES if s.name == args.stage)
    cfg = (NgramConfig(dim=16, vocab_size=512, bigram_rows=256, trigram_rows=256, cache_rows=2 * T,
                       bos_id=511) if args.smoke else NgramConfig(cache_rows=2 * T))
    store = NgramStore(NgramLookup(cfg).to(device), cycle=2, micro_steps=MICRO_BATCHES)
    lookup, acc = store.lookup, store.grad_acc
    tok = torch.from_numpy(tokens(args, T * MICRO_BATCHES)).to(device)
    batches = [tok[i * T:(i + 1) * T] for i in range(MICRO_BATCHES)]
    ids = [lookup.row_ids(b) for b in batches]  # [2T] each
    grad = torch.randn(2 * T, cfg.dim, device=device)  # [2T, R]
    sorted_ids = ids[0].sort().values

    def hold_of(held: NgramStore):
        def hold(i):
            held.hold(grad, ids[i % MICRO_BATCHES])
            held.pending = 0  # no event in this bench: only the bound is reset
        return hold

    ops = {
        "row_ids": lambda i: lookup.row_ids(batches[i % MICRO_BATCHES]),
        "slots_for": lambda i: store.slots_for(batches[i % MICRO_BATCHES], ids[i % MICRO_BATCHES]),
        "hold": hold_of(store),
        "index_add": lambda i: acc.index_add_(0, ids[i % MICRO_BATCHES], grad),
        "index_fill": lambda i: store.touched.index_fill_(0, ids[i % MICRO_BATCHES], 1),
        "index_put_accumulate": lambda i: acc.index_put_((ids[i % MICRO_BATCHES],), grad, accumulate=True),
        "index_add_sorted": lambda i: acc.index_add_(0, sorted_ids, grad),
        "copy": lambda i: grad.clone(),
    }
    if device.type == "cuda":
        from track_1_short.kernels.row_accumulate import row_accumulate_, row_accumulate_vector_
        ops["row_accumulate"] = lambda i: row_accumulate_(acc, ids[i % MICRO_BATCHES], grad)
        ops["row_accumulate_vector"] = lambda i: row_accumulate_vector_(acc, ids[i % MICRO_BATCHES], grad)
        for name in ("sorted", "vector_atomic"):
            held = NgramStore(lookup, cycle=2, micro_steps=MICRO_BATCHES, accumulate=name)
            ops[f"hold_{name}"] = hold_of(held)
    result = {"stage": args.stage, "tokens_per_micro_step": T, "rows": cfg.num_rows, "dim": cfg.dim,
              "distinct_rows_per_micro_step": int(ids[0].unique().numel()),
              "most_repeated_row_count": int(ids[0].bincount().max()), "ops_ms": {}}
    for name, fn in ops.items():
        fn(0)  # first call outside the timing (allocations, kernel loads)
        result["ops_ms"][name] = common.time_steps(fn, args.steps, device)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", default="C", choices=[s.name for s in SPEEDRUN_STAGES])
    p.add_argument("--steps", type=int, default=20, help="timed calls per op")
    p.add_argument("--data-dir", default="data/embedded-large")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny table, synthetic tokens")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    result = measure_and_write("bench/ngram_hold.py", args, measure)
    if result is None:
        return 2
    for name, stats in result["ops_ms"].items():
        print(f"{name:22s} {stats['median_ms']:8.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
