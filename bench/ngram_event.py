"""The n-gram update event alone (NgramStore.update_event on one GPU), at a stage's held rows on
real tokens: the event kernels (kernels/ngram_adam.py) against the store's reference path, and
optionally against an earlier version of the kernel module (an A/B in one process).

What it measures (one process, one GPU, CUDA events around update_event, median / p10 / p90 of
--events events): with the speedrun's NgramConfig (754,560 rows x 768, float32), each event applies
--held micro-batches of T tokens (the stage's tokens per rank; default 2: stage A's cycle of 2
steps of one micro-step, the 8-GPU run's per-rank regime) held with NgramStore.hold; the hold runs
before each event, outside the timing, into the first variant's store, whose accumulator and
touched flags are then copied into the others' (as tests/test_ngram_adam_gpu.py does: index_add_'s
float32 atomics sum in no fixed order, and Adam turns a near-zero sum's sign into a full lr step,
NgramConfig.lr 0.6, so separately held stores drift apart by whole steps). Every variant has its
own store from the same initial table, events interleaved, so their tables must agree:
`max_abs_diff_vs_first` (against the first variant, `kernel` on CUDA) is reported for each (0.0
expected between two kernels of the same math, float32 rounding for the reference). Also the touched rows per event and the bytes the lazy update must move (8 float32
row passes per touched row: read acc, m, v, table; write m, v, table and the zeroed acc; the
4-byte flags left out) as GB/s.

Variants: `kernel` (the store's event kernel), `reference` (the store's gathers and scatters,
NgramStore.event_kernel = None: two host syncs), and with --baseline-kernel FILE `baseline`: the
`sparse_adam_rows` of that file (e.g. `git show REV:track_1_short/kernels/ngram_adam.py > FILE`),
called with the arguments its signature names.

Run (H200): PYTHONPATH=. python bench/ngram_event.py --stage A --data-dir data/embedded --out ngram_event_A.json
Smoke (CPU, tiny table, synthetic tokens; the reference only): PYTHONPATH=. python bench/ngram_event.py --smoke --out /tmp/e.json
"""

from __future__ import annotations

import argparse
import inspect
import sys

import torch

from bench import common
from bench.common import UsageError, measure_and_write
from bench.ngram_hold import tokens
from track_1_short.model.ngram_config import NgramConfig
from track_1_short.model.ngram_lookup import NgramLookup
from track_1_short.perf.ngram_store import NgramStore
from track_1_short.schedule import SPEEDRUN_STAGES

ROW_PASSES = 8  # float32 row reads + writes per touched row (module docstring)


def load_baseline(path: str):
    """`sparse_adam_rows` of the module file `path`, adapted to the store's call (extra scratch
    arguments the older signature does not name are dropped)."""
    module = common.load_module_file(path, "track_1_short/kernels/ngram_adam.py",
                                     "ngram_adam_baseline")
    fn = getattr(module, "sparse_adam_rows", None)
    if fn is None:
        raise UsageError(f"--baseline-kernel {path}: defines no sparse_adam_rows")
    positional = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind is p.POSITIONAL_OR_KEYWORD]

    def call(*args, **kw):
        return fn(*args[:len(positional)], **kw)
    return call


def measure(args) -> dict:
    device = torch.device("cpu" if args.smoke else "cuda")
    T = 64 if args.smoke else next(s.tokens_per_rank for s in SPEEDRUN_STAGES if s.name == args.stage)
    cfg = (NgramConfig(dim=16, vocab_size=512, bigram_rows=256, trigram_rows=256, cache_rows=2 * T,
                       bos_id=511) if args.smoke else NgramConfig(cache_rows=2 * T))
    tok = torch.from_numpy(tokens(args, T * args.held)).to(device)
    lookup = NgramLookup(cfg).to(device)
    ids = [lookup.row_ids(tok[i * T:(i + 1) * T]) for i in range(args.held)]  # [2T] each
    gen = torch.Generator(device=device).manual_seed(0)
    grads = [torch.randn(2 * T, cfg.dim, generator=gen, device=device) for _ in ids]  # [2T, R]
    init = torch.randn(cfg.num_rows, cfg.dim, generator=gen, device=device) * 0.02
    if args.baseline_kernel and device.type != "cuda":
        raise UsageError("--baseline-kernel needs a CUDA GPU (the smoke run times the reference only)")
    kernels = {"reference": None}
    if device.type == "cuda":
        kernels = {"kernel": "store", **kernels}
        if args.baseline_kernel:
            kernels["baseline"] = load_baseline(args.baseline_kernel)
    stores = {}
    for name, kernel in kernels.items():
        store = NgramStore(lookup, cycle=1, micro_steps=args.held)
        if kernel != "store":
            store.event_kernel = kernel
        store.table.copy_(init)
        stores[name] = store
    touched = torch.zeros(cfg.num_rows, dtype=torch.bool, device=device)
    for i in ids:
        touched[i] = True
    result = {"stage": args.stage, "tokens_per_micro_step": T, "held_micro_steps": args.held,
              "rows": cfg.num_rows, "dim": cfg.dim, "touched_rows": int(touched.sum()),
              "variants": {}}
    moved_gb = result["touched_rows"] * cfg.dim * 4 * ROW_PASSES / 1e9
    cuda = device.type == "cuda"
    source = next(iter(stores.values()))
    times = {name: [] for name in stores}
    for event in range(args.events + 1):  # event 0 untimed: compilation, first loads
        for i, g in zip(ids, grads):
            source.hold(g, i)
        for store in stores.values():  # the same sums for every variant (module docstring)
            if store is not source:
                store.grad_acc.copy_(source.grad_acc)
                store.touched.copy_(source.touched)
                store.pending = source.pending
        for name, store in stores.items():
            common.sync(device)
            start = common._mark(cuda)
            store.update_event(event, 1.0)
            end = common._mark(cuda)
            common.sync(device)
            if event:
                times[name].append(common._elapsed(start, end, cuda))
    for name, ms in times.items():
        stats = common.summarize(ms)
        result["variants"][name] = {"event_ms": stats,
                                    "gb_per_s": round(moved_gb / (stats["median_ms"] / 1e3), 1)}
    for name, store in stores.items():
        diff = (store.table - source.table).abs().max()
        result["variants"][name]["max_abs_diff_vs_first"] = float(diff)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", default="A", choices=[s.name for s in SPEEDRUN_STAGES])
    p.add_argument("--held", type=int, default=2, help="micro-batches held per event (>= 1)")
    p.add_argument("--events", type=int, default=20, help="timed events per variant (>= 1)")
    p.add_argument("--data-dir", default="data/embedded")
    p.add_argument("--baseline-kernel", default=None, help="an earlier kernels/ngram_adam.py")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny table, synthetic tokens")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    for flag, value in (("--held", args.held), ("--events", args.events)):
        if value < 1:
            print(f"bench/ngram_event.py: {flag} {value} must be >= 1", file=sys.stderr)
            return 2
    result = measure_and_write("bench/ngram_event.py", args, measure)
    if result is None:
        return 2
    print(f"stage {result['stage']}: {result['touched_rows']} of {result['rows']} rows touched")
    first = next(iter(result["variants"]))
    for name, v in result["variants"].items():
        print(f"{name:10s} {v['event_ms']['median_ms']:8.3f} ms  {v['gb_per_s']:8.1f} GB/s  "
              f"max |diff| vs {first} {v['max_abs_diff_vs_first']:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
