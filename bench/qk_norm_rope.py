"""The q/k rms-norm + RoPE kernels alone (kernels/qk_norm_rope.py) at a stage's shapes: forward
and backward kernel time per call for several launch tilings and, optionally, an earlier version
of the kernel module (an A/B in one process), against the pair's memory floor.

What it measures (one process, one GPU): for each --stages stage (T = its tokens per rank, the
speedrun model's H heads of D, bfloat16) and each layer kind (unpaired [T, H, D] outputs, paired
[2T, H/2, D]), each variant's forward and backward kernels run --calls times eagerly under
torch.profiler (CUDA activity only); per kernel, its device time per call (the profiler's
durations: the host's launch cost is not in them). Bytes each kernel must move (the floor):
forward reads qk and writes q, k and the row scales; backward reads q's and k's gradients, qk
and the row scales and writes qk's gradient; both read the rotating half of each position's
table row (float32 cos and sin, columns [0, D/2)) once (docs/results/qk_norm_rope_h100_2026-12-07/
counted whole rows, as the kernels then read them). `gb_per_s` = floor bytes / kernel time.
Every variant's outputs are compared with the first's (`max_abs_diff_vs_first`; 0.0 expected
between tilings: a row's math does not depend on its program).

Variants: `tile_{block_rows}x{num_warps}` per --tilings entry (kernels/qk_norm_rope.Tiling; the
first is the first variant) and, with --baseline-kernel FILE (e.g. `git show
REV:track_1_short/kernels/qk_norm_rope.py > FILE`), `baseline`: that file's forward_into /
backward_into at its default Tiling, or for the first version (7784b2d and before, no
forward_into) its `_fwd` / `_bwd` launched as its `_launch(qk, paired)` says. The file is
executed with its custom ops renamed into the `qk_norm_rope_baseline` namespace, so both
versions register side by side.

Run (GPU):
    PYTHONPATH=. python bench/qk_norm_rope.py --baseline-kernel OLD.py --out qk_norm_rope.json
Smoke (CPU, tiny shapes, in the Triton interpreter, which --smoke turns on; wall-clock times):
    PYTHONPATH=. python bench/qk_norm_rope.py --smoke --out /tmp/q.json

Legend: T tokens, H heads, D head_dim.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import types

import torch

from bench import common
from bench.common import UsageError, measure_and_write
from track_1_short.model.gpt_config import GPTConfig
from track_1_short.model.yarn import Yarn
from track_1_short.perf import profiling
from track_1_short.schedule import SPEEDRUN_STAGES


def load_baseline(path: str) -> types.ModuleType:
    """The kernel module file `path`, its custom ops renamed (module docstring)."""
    module = common.load_module_file(path, "track_1_short/kernels/qk_norm_rope.py",
                                     "qk_norm_rope_baseline",
                                     rename=('"track_1_short::', '"qk_norm_rope_baseline::'))
    first_version = all(hasattr(module, n) for n in ("_fwd", "_bwd", "_launch"))
    if not (hasattr(module, "forward_into") or first_version):
        raise UsageError(f"--baseline-kernel {path}: defines neither forward_into nor "
                         f"_fwd/_bwd/_launch")
    return module


def parse_tilings(text: str, kernels) -> list:
    """'32x4,64x8' -> Tiling(block_rows, num_warps) each (UsageError naming the bad entry)."""
    out = []
    for item in text.split(","):
        try:
            rows, warps = (int(v) for v in item.split("x"))
            out.append(kernels.Tiling(block_rows=rows, num_warps=warps))
        except ValueError as e:
            raise UsageError(f"--tilings {item!r}: want ROWSxWARPS, powers of two ({e})") from None
    return out


def _variants(kernels, tilings, baseline):
    """name -> (forward(qk, cos, sin, paired) -> (q, k, rstd), backward(gq, gk, qk, cos, sin,
    rstd, paired) -> dqk)."""
    def current_of(module, tiling):
        def fwd(qk, cos, sin, paired):
            q, k, rstd = kernels._qk_norm_rope_fake(qk, cos, sin, paired)
            module.forward_into(qk, cos, sin, paired, q, k, rstd, tiling)
            return q, k, rstd

        def bwd(gq, gk, qk, cos, sin, rstd, paired):
            dqk = torch.empty_like(qk)
            module.backward_into(gq, gk, qk, cos, sin, rstd, paired, dqk, tiling)
            return dqk
        return fwd, bwd
    out = {f"tile_{t.block_rows}x{t.num_warps}": current_of(kernels, t) for t in tilings}
    if baseline is not None and hasattr(baseline, "forward_into"):  # this version or a later one
        out["baseline"] = current_of(baseline, baseline.Tiling())
    elif baseline is not None:  # the first version: its own launch, one program per 16 rows
        def fwd(qk, cos, sin, paired):
            q, k, rstd = kernels._qk_norm_rope_fake(qk, cos, sin, paired)
            n_rows, grid, meta = baseline._launch(qk, paired)
            eps = torch.finfo(torch.float32).eps
            baseline._fwd[grid](qk, cos, sin, q, k, rstd, n_rows, eps, **meta)
            return q, k, rstd

        def bwd(gq, gk, qk, cos, sin, rstd, paired):
            dqk = torch.empty_like(qk)
            n_rows, grid, meta = baseline._launch(qk, paired)
            baseline._bwd[grid](gq, gk, qk, cos, sin, rstd, dqk, n_rows, **meta)
            return dqk
        out["baseline"] = (fwd, bwd)
    return out


def _floor_bytes(t: int, h: int, d: int, paired: bool, elt: int) -> dict[str, int]:
    """The bytes each kernel must move at least (module docstring), `elt` bytes per activation."""
    act = t * 2 * h * d * elt  # qk, or q and k together, or their gradients
    scales = t * 2 * h * 4
    # the rotating half (columns [0, D/2), each pair's value repeated) of the float32 cos and sin
    # rows, once per position: the stationary half is never read
    table = (2 * t if paired else t) * (d // 2) * 4 * 2
    return {"forward": 2 * act + scales + table, "backward": 3 * act + scales + table}


def _kernel_ms(fn, calls: int, device: torch.device) -> dict[str, float]:
    """Device ms per call of each kernel fn launches (CUDA), or fn's wall ms per call (CPU)."""
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return {"wall": (time.perf_counter() - start) * 1e3 / calls}
    events = common.device_events(lambda i: fn(), calls, device)
    return {k["name"]: k["ms_per_step"] for k in profiling.top_kernels(events, calls, 8)}


def measure(args) -> dict:
    device = torch.device("cpu" if args.smoke else "cuda")
    # imports triton, after main's TRITON_INTERPRET setting
    from track_1_short.kernels import qk_norm_rope as kernels
    cfg = GPTConfig()
    h, d = (6, 16) if args.smoke else (cfg.num_heads, cfg.head_dim)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    baseline = load_baseline(args.baseline_kernel) if args.baseline_kernel else None
    variants = _variants(kernels, parse_tilings(args.tilings, kernels), baseline)
    stages = [s for s in SPEEDRUN_STAGES if s.name in args.stages.split(",")]
    if not stages:
        raise UsageError(f"--stages {args.stages!r}: none of {[s.name for s in SPEEDRUN_STAGES]}")
    result = {"heads": h, "head_dim": d, "dtype": str(dtype), "cases": {}}
    gen = torch.Generator(device=device).manual_seed(0)
    for stage in stages:
        t = 13 if args.smoke else stage.tokens_per_rank
        for paired in (False, True):
            yarn = Yarn(d, 2 * t, paired=paired).to(device)
            cos, sin = yarn.head_tables()
            qk = torch.randn(t, 2, h, d, generator=gen, device=device).to(dtype)
            gq, gk = (torch.randn(t * h, d, generator=gen, device=device).to(dtype)
                      for _ in range(2))
            floor = _floor_bytes(t, h, d, paired, qk.element_size())
            case = {"tokens": t, "paired": paired, "floor_bytes": floor, "variants": {}}
            first = None
            for name, (fwd, bwd) in variants.items():
                outs = fwd(qk, cos, sin, paired)  # first calls: compilation, outside the timing
                dqk = bwd(gq, gk, qk, cos, sin, outs[2], paired)
                got = (*outs, dqk)
                first = first or got
                row = {"max_abs_diff_vs_first": max(float((a.float() - b.float()).abs().max())
                                                    for a, b in zip(got, first))}
                for part, fn in (("forward", lambda: fwd(qk, cos, sin, paired)),
                                 ("backward", lambda: bwd(gq, gk, qk, cos, sin, outs[2], paired))):
                    per_kernel = _kernel_ms(fn, args.calls, device)
                    ms = sum(per_kernel.values())
                    row[part] = {"ms": ms, "kernels": per_kernel,
                                 "gb_per_s": round(floor[part] / (ms / 1e3) / 1e9, 1)}
                case["variants"][name] = row
            result["cases"][f"{stage.name}_{'paired' if paired else 'unpaired'}"] = case
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", default="A,C", help="comma-separated speedrun stages")
    p.add_argument("--tilings", default="16x4,8x4,32x4,16x8,32x8,64x8",
                   help="BLOCK_ROWSxNUM_WARPS entries; the first is the reference variant")
    p.add_argument("--calls", type=int, default=20, help="profiled calls per kernel (>= 1)")
    p.add_argument("--baseline-kernel", default=None, help="an earlier kernels/qk_norm_rope.py")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, Triton interpreter")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.smoke:  # before triton's first import (it decides at decoration time); this is a script
        os.environ["TRITON_INTERPRET"] = "1"
    if args.calls < 1:
        print(f"bench/qk_norm_rope.py: --calls {args.calls} must be >= 1", file=sys.stderr)
        return 2
    result = measure_and_write("bench/qk_norm_rope.py", args, measure)
    if result is None:
        return 2
    for key, case in result["cases"].items():
        for name, v in case["variants"].items():
            print(f"{key:12s} {name:12s} fwd {v['forward']['ms'] * 1e3:8.1f} us "
                  f"{v['forward']['gb_per_s']:7.1f} GB/s  bwd {v['backward']['ms'] * 1e3:8.1f} us "
                  f"{v['backward']['gb_per_s']:7.1f} GB/s  |diff| {v['max_abs_diff_vs_first']:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
