"""Loss benchmark: the fused lm-head + softcapped CE op against the compiled torch path, as JSON.

What it measures, per key (--keys A,C; stage A: T = 16,384, N = 3 with prefix ids, stage C:
T = 49,152, N = 1, prefix weight 0; V = 50,304, D = 768, bf16, one rank's micro-step shapes):
- forward + backward (dx, dw by torch.autograd.grad of loss.sum()) of
  `torch`:          training_loss(softcap(x @ w), ...) as GPT.forward runs it, under
                    torch.compile(fullgraph=True, dynamic=False) (eager with --smoke);
  `fused`:          kernels/softcap_ce.linear_softcap_ce, eager (op + autograd);
  `fused_compiled`: the same under torch.compile(fullgraph=True, dynamic=False) (not --smoke);
  `gemms`:          the three GEMMs alone (x @ w, dz @ w^T, x^T @ dz): the floor both share, so
                    `<variant> - gemms` is what the loss costs beyond its GEMMs;
  `kernel`:         the Triton kernel alone (softcap_ce_rows_) on a logits buffer it overwrites
                    each call (later calls read gradients as logits: same work, same time);
- median / p10 / p90 ms over --iters steps from CUDA events at step boundaries (common.time_steps),
  after --warmup untimed steps; peak memory above the inputs per variant;
- errors against a float32 reference (the logit gradient by autograd of the torch path on the
  same bf16 logits in float32, GEMMs in float32): loss max abs, dx and dw relative (Frobenius),
  for the fused op and for the torch path;
- --sweep: the kernel alone for several LaunchConfigs (block_v, num_warps, programs_per_sm,
  fast_math, fma_exp_passes, tanh_sigmoid, one_pass, recompute: the fp8 head's forward, which
  writes no gradient), and the errors of the default launch with
  tanh_sigmoid and with one_pass; --sweep-only: that alone, with the default launch's kernel
  first (no torch path, no compile: ~1 min on the H200 for both keys with --sweep-tanh-only).

Run (H200, ~3 min, mostly the torch path's compile):
    PYTHONPATH=. python bench/loss_kernel.py --out docs/results/loss_kernel_h200.json --sweep
Smoke (CPU, Triton interpreter, tiny shapes and chunks, no compile; ~20 s):
    PYTHONPATH=. python bench/loss_kernel.py --smoke --out /tmp/loss_kernel.json

Legend: T tokens, D model dim, V vocab, N MTP targets.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from bench import common
from track_1_short.model.loss import softcap, training_loss

FULL_SHAPES = {"V": 50304, "D": 768}
SMOKE_SHAPES = {"V": 300, "D": 32}
SMOKE_TOKENS = {"A": 24, "C": 40}
TOKEN_IDS = 50257
# LaunchConfig.from_op_args of each sweep row: (block_v, num_warps, programs_per_sm, fast_math,
# fma_exp_passes, tanh_sigmoid, one_pass[, recompute]); recompute False where left out
SWEEP = (
    (4096, 8, 8, True, 0, False, False), (4096, 8, 8, True, 1, False, False),
    (4096, 8, 8, True, 2, False, False), (4096, 8, 8, False, 1, False, False),
    (4096, 16, 4, True, 1, False, False), (4096, 16, 4, True, 2, False, False),
    (4096, 8, 4, True, 1, False, False), (4096, 16, 2, True, 1, False, False),
    (2048, 4, 8, True, 1, False, False), (2048, 8, 4, True, 1, False, False),
    (2048, 4, 16, True, 1, False, False), (8192, 16, 4, True, 1, False, False),
    # the sigmoid as one tanh.approx: 3 MUFU ops per element instead of 5, so fewer rows in
    # flight may now keep pass 2's re-read of the row in L2
    (4096, 8, 8, True, 1, True, False), (4096, 8, 8, True, 2, True, False),
    (4096, 8, 4, True, 1, True, False), (4096, 8, 4, True, 2, True, False),
    (4096, 8, 2, True, 1, True, False), (4096, 16, 2, True, 1, True, False),
    (4096, 16, 4, True, 2, True, False), (2048, 4, 8, True, 1, True, False),
    (8192, 16, 2, True, 1, True, False),
    # one pass over each row (the gradient up to a row scale): one read and one write per element;
    # fma_exp_passes 2 puts its exp on the FMA pipes
    (2048, 4, 8, True, 1, True, True), (2048, 4, 8, True, 2, True, True), (2048, 4, 16, True, 1, True, True),
    (4096, 8, 8, True, 1, True, True), (4096, 8, 4, True, 1, True, True), (4096, 16, 4, True, 1, True, True),
    (1024, 4, 8, True, 1, True, True), (1024, 2, 16, True, 1, True, True),
    # the recompute schedule's forward (one pass without its stores: one read per element, two
    # MUFU ops; it ran at the one-pass launch, 4096 / 8 / 8, not swept): more rows in flight may
    # hide more of the read's latency now that nothing is written
    (4096, 8, 8, True, 1, True, True, True), (4096, 8, 16, True, 1, True, True, True),
    (4096, 4, 16, True, 1, True, True, True), (2048, 4, 16, True, 1, True, True, True),
    (2048, 4, 8, True, 1, True, True, True), (8192, 16, 4, True, 1, True, True, True),
    (4096, 16, 4, True, 1, True, True, True),
)


@dataclass(slots=True, frozen=True, kw_only=True)
class LossKey:
    name: str
    tokens: int  # T
    mtp_weights: tuple[float, ...]
    prefix_weight: float


def loss_keys(names: str, smoke: bool) -> list[LossKey]:
    """Stage A's and C's first-step values from the schedule (bench/common.key_specs)."""
    specs = common.key_specs(smoke=False)
    out = []
    for name in [n.strip() for n in names.split(",") if n.strip()]:
        if name not in SMOKE_TOKENS:
            raise SystemExit(f"--keys: unknown {name!r}; choose from {sorted(SMOKE_TOKENS)}")
        s = specs[name]
        out.append(LossKey(name=name, tokens=SMOKE_TOKENS[name] if smoke else s.tokens,
                           mtp_weights=s.mtp_weights, prefix_weight=s.prefix_weight))
    return out


def make_inputs(key: LossKey, shapes: dict, device: torch.device, seed: int) -> tuple:
    """x [T, D] (unit rms), w [D, V] (logits of std ~3), targets, MTP weights, prefix weight,
    prefix ids (-1 on ~40%), as the op takes them."""
    g = torch.Generator(device=device).manual_seed(seed)
    t, d, v = key.tokens, shapes["D"], shapes["V"]
    x = torch.randn(t, d, device=device, generator=g).bfloat16()
    w = (torch.randn(d, v, device=device, generator=g) * (2.8 / d ** 0.5)).bfloat16()
    ids = min(v, TOKEN_IDS)
    targets = torch.randint(0, ids, (t,), device=device, generator=g)
    prefix = torch.randint(0, ids, (t,), device=device, generator=g)
    prefix = torch.where(torch.rand(t, device=device, generator=g) < 0.4, -1, prefix)
    return (x.requires_grad_(), w.requires_grad_(), targets,
            torch.tensor(key.mtp_weights, device=device), torch.tensor(key.prefix_weight, device=device),
            prefix)


def torch_path(x, w, targets, mtp, pw, prefix):
    return training_loss(softcap(x @ w), targets, mtp, pw, prefix)


def rel_err(a, ref) -> float:
    return float((a.float() - ref).norm() / ref.norm())


def errors(args: tuple, fused_fn) -> dict:
    """Loss max abs and dx/dw relative errors of the fused op and the torch path against the
    float32 reference (module docstring)."""
    x, w, *rest = args
    with torch.no_grad():
        z = torch.mm(x, w).float()  # [T, V], the op's own bf16 logits
    z.requires_grad_()
    loss_ref = training_loss(softcap(z), *rest)
    (dz,) = torch.autograd.grad(loss_ref.sum(), z)
    dx_ref, dw_ref = dz @ w.detach().float().T, x.detach().float().T @ dz
    del z, dz
    out = {}
    for name, fn in (("fused", fused_fn), ("torch", torch_path)):
        loss = fn(*args)
        dx, dw = torch.autograd.grad(loss.sum(), (x, w))
        out[name] = {"loss_max_abs": float((loss.detach() - loss_ref.detach()).abs().max()),
                     "dx_rel": rel_err(dx, dx_ref), "dw_rel": rel_err(dw, dw_ref)}
    out["loss_scale"] = float(loss_ref.detach().abs().max())
    return out


def variants(args: tuple, compile_on: bool, fused, kernels, launch) -> dict:
    """name -> step function (forward + backward, or the GEMMs / kernel alone)."""
    x, w, targets, mtp, pw, prefix = args
    compiled_torch = torch.compile(torch_path, fullgraph=True, dynamic=False) if compile_on else torch_path
    logits = torch.mm(x.detach(), w.detach())  # [T, V], overwritten by every `kernel` call

    def fwd_bwd(fn):
        def step(_):
            torch.autograd.grad(fn(*args).sum(), (x, w))
        return step

    def gemms(_):
        with torch.no_grad():
            z = torch.mm(x, w)
            torch.mm(z, w.t()), torch.mm(x.t(), z)

    out = {"torch": fwd_bwd(compiled_torch), "fused": fwd_bwd(fused), "gemms": gemms,
           "kernel": lambda _: kernels.softcap_ce_rows_(logits, targets, mtp, pw, prefix, launch)}
    if compile_on:
        out["fused_compiled"] = fwd_bwd(torch.compile(fused, fullgraph=True, dynamic=False))
    return out


def time_variant(step, device: torch.device, iters: int, warmup: int) -> dict:
    """Compile/warm (1 + warmup untimed calls), then time; peak memory of one call above what
    was allocated before it."""
    for i in range(1 + warmup):
        step(i)
    peak = None
    if device.type == "cuda":
        common.sync(device)
        base = torch.cuda.memory_allocated(device)
        common.reset_peak(device)
        step(0)
        common.sync(device)
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2**30
    return {**common.time_steps(step, iters, device), "peak_extra_gib": peak}


def bench_key(key: LossKey, shapes: dict, device: torch.device, a, kernels) -> dict:
    args = make_inputs(key, shapes, device, seed=0)
    launch = launch_config(kernels, a.smoke)
    fused = functools.partial(kernels.linear_softcap_ce, launch=launch)
    row = {"tokens": key.tokens, "mtp_weights": key.mtp_weights, "prefix_weight": key.prefix_weight,
           **shapes, "errors": errors(args, fused), "variants": {}}
    for name, step in variants(args, not a.smoke, fused, kernels, launch).items():
        if a.sweep_only and name != "kernel":
            continue
        row["variants"][name] = time_variant(step, device, a.iters, a.warmup)
        print(f"key {key.name} {name}: {row['variants'][name]['median_ms']:.3f} ms", flush=True)
    ms = {n: v["median_ms"] for n, v in row["variants"].items()}
    if not a.sweep_only:
        row["loss_beyond_gemms_ms"] = {n: ms[n] - ms["gemms"] for n in ms if n not in ("gemms", "kernel")}
        row["torch_over_fused"] = ms["torch"] / ms["fused"]
    if a.sweep:
        for name, change in (("tanh_sigmoid", {"tanh_sigmoid": True}),
                             ("one_pass", {"tanh_sigmoid": True, "one_pass": True})):
            other = dataclasses.replace(launch, **change)
            row[f"errors_{name}"] = errors(args, functools.partial(kernels.linear_softcap_ce, launch=other))
        a.sweep_errors = row["sweep_errors"] = {}
        row["sweep"] = sweep(args, device, a, kernels)
    return row


def sweep(args: tuple, device: torch.device, a, kernels) -> list[dict]:
    x, w, targets, mtp, pw, prefix = args
    logits = torch.mm(x.detach(), w.detach())
    rows = []
    for row in SWEEP:
        launch = kernels.LaunchConfig.from_op_args(*row, *(False,) * (len(kernels.LAUNCH_FIELDS) - len(row)))
        if a.sweep_tanh_only and not launch.tanh_sigmoid:
            continue
        fields = dataclasses.asdict(launch)

        def step(_, launch=launch):
            kernels.softcap_ce_rows_(logits, targets, mtp, pw, prefix, launch)
        t = common.run_guarded(f"sweep {launch}", lambda: time_variant(step, device, a.iters, a.warmup),
                               a.sweep_errors)
        if t is not None:
            rows.append({**fields, **t})
            print("  sweep " + " ".join(f"{k}={v}" for k, v in fields.items()) + f": {t['median_ms']:.3f} ms",
                  flush=True)
    return rows


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--keys", default="A,C")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after the compiling one")
    p.add_argument("--out", type=Path, default=Path("docs/results/loss_kernel_h200.json"))
    p.add_argument("--sweep", action="store_true", help="also time the kernel for several LaunchConfigs")
    p.add_argument("--sweep-only", action="store_true",
                   help="the kernel alone: the default launch, then the sweep (implies --sweep)")
    p.add_argument("--sweep-tanh-only", action="store_true",
                   help="sweep only the launches with tanh_sigmoid (the others: docs/results/loss_kernel_h200.json)")
    p.add_argument("--smoke", action="store_true",
                   help="CPU, Triton interpreter, tiny shapes, 2 steps, no compile, no sweep")
    a = p.parse_args(argv)
    if a.smoke and a.sweep_only:
        p.error("--sweep-only times the GPU kernel; --smoke runs no sweep")
    a.sweep = a.sweep or a.sweep_only
    if a.smoke:
        a.iters, a.warmup, a.sweep = min(a.iters, 2), 0, False
    return a


def launch_config(kernels, smoke: bool):
    """The op's default launch; --smoke: narrow chunks (the interpreter's time grows with the
    chunk width, and V = 300 then spans two chunks and a tail)."""
    if smoke:
        return kernels.LaunchConfig(block_v=256, num_warps=4, programs_per_sm=2)
    return kernels.DEFAULT_LAUNCH


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    device = torch.device("cpu" if a.smoke else "cuda:0")
    if a.smoke:  # before triton's first import (it decides at decoration time); this is a script
        os.environ["TRITON_INTERPRET"] = "1"
    from track_1_short.kernels import softcap_ce as kernels  # imports triton
    settings = common.setup_torch(device)
    shapes = SMOKE_SHAPES if a.smoke else FULL_SHAPES
    results = common.Results(a.out, device, bench="loss_kernel", source="bench/loss_kernel.py",
                             settings={**settings, "iters": a.iters, "warmup": a.warmup, "smoke": a.smoke,
                                       "launch": str(launch_config(kernels, a.smoke)),
                                       "interpreted": kernels.interpreted()},
                             keys={}, errors={})
    for key in loss_keys(a.keys, a.smoke):
        row = common.run_guarded(f"key {key.name}", lambda: bench_key(key, shapes, device, a, kernels),
                                 results.data["errors"])
        if row is not None:
            results.data["keys"][key.name] = row
        results.save()
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the next key's tensors are 3x larger
    results.data["complete"] = True
    results.save()
    rows = [{"key": k, **{n: v["median_ms"] for n, v in r["variants"].items()}}
            for k, r in results.data["keys"].items()]
    common.print_table(rows, ["key", "torch", "fused", "fused_compiled", "gemms", "kernel"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
