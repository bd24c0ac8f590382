"""Model FLOPs of real corpus batches vs the benches' synthetic ones, per key, as JSON (CPU only).

Why: bench/model.py and bench/step_graphs.py time synthetic packed batches (document lengths
lognormal around 400 tokens, bench/common.py), while the trainer reads the corpus, whose documents
can be longer; attention work grows with the piece lengths, so a trainer micro-step could cost more
than the bench's for that reason alone. This measures how much, in model FLOPs.

What it computes, per key (--keys), over --batches batches each:
- real pieces: the trainer's own packing (data.TrainStream, seeded document order, each document
  cut at the key's max_seq_len, the last cut to fill T + 1 tokens); every piece starts at a BOS;
- synthetic pieces: common.synthetic_batch with the seeds bench/model.py uses (1000 + T + i);
- bench/model.py's FLOPs (dense + exact causal attention) of each; the ratio real / synthetic
  (median, min, max), mean piece lengths and attention's share of the FLOPs.
Run: PYTHONPATH=. python bench/corpus_flops.py --data-dir data/embedded --out docs/results/corpus_flops.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

from bench import common
from bench.model import flops
from track_1_short import config as config_mod
from track_1_short.data import BOS_ID, SliceShape, TrainStream, list_shards
from track_1_short.atomic_io import write_json_atomic


def real_pieces(stream: TrainStream, spec: common.KeySpec) -> list[int]:
    """The next micro-batch's piece lengths (sum T + 1) as the trainer packs it."""
    tokens = np.empty(spec.tokens + 1, dtype=np.int32)
    cu = np.empty(spec.cu_seqlens_rows, dtype=np.int32)
    stream.next_slice(SliceShape(spec.tokens, spec.max_seq_len, spec.cu_seqlens_rows), tokens, cu)
    starts = np.flatnonzero(tokens == BOS_ID)  # each piece starts with its document's BOS
    return np.diff(np.append(starts, spec.tokens + 1)).tolist()


def key_row(c, spec: common.KeySpec, data_dir: Path, batches: int, seed: int) -> dict:
    stream = TrainStream(list_shards(data_dir, "train"), seed=seed)
    ratios, real_len, synth_len, real_share, synth_share = [], [], [], [], []
    for i in range(batches):
        real = real_pieces(stream, spec)
        _, synth = common.synthetic_batch(spec, "cpu", seed=1000 + spec.tokens + i)
        fr, fs = flops(c, spec, real), flops(c, spec, synth)
        total_r = fr["dense_flops"] + fr["attention_exact_causal_flops"]
        total_s = fs["dense_flops"] + fs["attention_exact_causal_flops"]
        ratios.append(total_r / total_s)
        real_len.append(float(np.mean(real)))
        synth_len.append(float(np.mean(synth)))
        real_share.append(fr["attention_exact_causal_flops"] / total_r)
        synth_share.append(fs["attention_exact_causal_flops"] / total_s)
    med = statistics.median
    return {"tokens": spec.tokens, "max_seq_len": spec.max_seq_len, "ws_short": spec.ws_short,
            "ws_long": spec.ws_long, "flops_real_over_synthetic": {
                "median": med(ratios), "min": min(ratios), "max": max(ratios)},
            "mean_piece_real": med(real_len), "mean_piece_synthetic": med(synth_len),
            "attention_share_real": med(real_share), "attention_share_synthetic": med(synth_share)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-dir", type=Path, default=Path("data/embedded"))
    p.add_argument("--keys", default="A,B,C,D")
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("docs/results/corpus_flops.json"))
    args = p.parse_args(argv)
    c = config_mod.preset("speedrun").model
    specs = common.select_specs(args.keys, smoke=False, half_key=False)
    result = {"bench": "bench/corpus_flops.py", "command": common.command(),
              "data_dir": str(args.data_dir), "batches": args.batches,
              "flops": "bench/model.py FLOPS_FORMULA, attention counted exactly (causal, windowed)",
              "keys": {s.name: key_row(c, s, args.data_dir, args.batches, args.seed) for s in specs}}
    write_json_atomic(args.out, result)
    for name, row in result["keys"].items():
        r = row["flops_real_over_synthetic"]
        print(f"{name}: real / synthetic FLOPs {r['median']:.4f} ({r['min']:.4f}-{r['max']:.4f}); mean "
              f"piece {row['mean_piece_real']:.0f} vs {row['mean_piece_synthetic']:.0f}; attention "
              f"share {row['attention_share_real']:.3f} vs {row['attention_share_synthetic']:.3f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
