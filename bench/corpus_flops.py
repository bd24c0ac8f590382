"""Model FLOPs of real corpus batches vs the benches' synthetic ones, per key, as JSON (CPU only).

Why: bench/model.py and bench/step_graphs.py time synthetic packed batches (document lengths
lognormal around 400 tokens, bench/common.py), while the trainer reads the corpus, whose documents
can be longer; attention work grows with the piece lengths, so a trainer micro-step could cost more
than the bench's for that reason alone. This measures how much, in model FLOPs.

What it computes, per key (--keys), over --batches batches each:
- real pieces: the corpus's documents (split at BOS) in a seeded random order, each cut at the key's
  max_seq_len and the last cut to fill T + 1 tokens (how data.py packs a micro-batch);
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
from track_1_short.data import BOS_ID, list_shards, read_shard
from track_1_short.report import write_json_atomic


def corpus_lengths(data_dir: Path) -> np.ndarray:
    """Document lengths (tokens from one BOS to the next) over every train shard of data_dir."""
    shards = list_shards(data_dir, "train")
    lens = []
    for path in shards:
        tokens = np.asarray(read_shard(path))
        starts = np.flatnonzero(tokens == BOS_ID)
        if starts.size == 0:
            raise SystemExit(f"{path}: no BOS ({BOS_ID}) token, not a document-packed shard")
        lens.append(np.diff(np.append(starts, tokens.size)))
    return np.concatenate(lens)


def real_pieces(lens: np.ndarray, spec: common.KeySpec, rng: np.random.Generator) -> list[int]:
    """One micro-batch's piece lengths, packed as data.py packs documents."""
    pieces, filled = [], 0
    while filled < spec.tokens + 1:
        for d in rng.permutation(lens.size):
            take = min(int(lens[d]), spec.max_seq_len, spec.tokens + 1 - filled)
            pieces.append(take)
            filled += take
            if filled >= spec.tokens + 1:
                break
    return pieces


def key_row(c, spec: common.KeySpec, lens: np.ndarray, batches: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    ratios, real_len, synth_len, real_share, synth_share = [], [], [], [], []
    for i in range(batches):
        real = real_pieces(lens, spec, rng)
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
    lens = corpus_lengths(args.data_dir)
    specs = common.select_specs(args.keys, smoke=False, half_key=False)
    result = {"bench": "bench/corpus_flops.py", "command": common.command(),
              "data_dir": str(args.data_dir), "documents": int(lens.size),
              "mean_document": float(lens.mean()), "batches": args.batches,
              "flops": "bench/model.py FLOPS_FORMULA, attention counted exactly (causal, windowed)",
              "keys": {s.name: key_row(c, s, lens, args.batches, args.seed) for s in specs}}
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
