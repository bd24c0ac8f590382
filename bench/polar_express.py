"""Polar Express per ANVIL bank shape: torch's GEMMs (bmm / baddbmm) against quack's
(kernels/polar_gemms.py, optim.polar_gemms=quack), compiled as the optimizer compiles it.

Why: baddbmm with beta != 0 copies its C operand into the output before the GEMM (x and the Gram
matrix, every iteration); quack's gemm_add reads C in the epilogue and gemm_symmetric computes
one triangle of the two symmetric products. Prediction (docs/results/scripts/polar_call.sh):
~0.4-0.6 ms saved per even optimizer step on one H200, more if gemm_symmetric's half-tile
schedule pays.

Per bank (the speedrun model's, one rank: `bank_shapes`, read from the model built on the meta
device; matrices [M, R, C] as AnvilAndAdam views them) and strategy: polar_express(g, bf16,
gemms=...) under torch.compile(dynamic=False, fullgraph=True) (inductor, as
AnvilConfig.compile wraps anvil_bank_step_); --warmup untimed calls (compile, quack's JIT and
autotuning), then --steps calls timed with CUDA events (event_ms: median, p10, p90), --steps
calls profiled one at a time (device_busy_ms, kernel_ms, memcpy_ms per call: summarize; memcpys
and kernels per call) and one batch of --steps profiled for the top kernels
(bench/common.device_time_ms). `saving_ms`: torch's median device-busy ms minus quack's, per
bank and summed over the banks (one even step orthogonalises each bank once). quack unavailable
(no CUDA, other compute capability, no quack-kernels): its rows hold the reason.

Usage, one H200 (~2 min, mostly compile and quack's JIT):
    PYTHONPATH=. python bench/polar_express.py --out $OUT/polar_express.json
Smoke (CPU, torch's GEMMs only, tiny banks, eager): python bench/polar_express.py --smoke --out /tmp/pe.json
Output JSON: {command, machine, settings, banks: {name: {shape, strategies: {torch|quack:
{event_ms, device_busy_ms, kernel_ms, memcpy_ms, memcpys_per_call, kernels_per_call,
top_kernels} | {unavailable} | {error}}, saving_ms}}, saving_ms_per_even_step, complete}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from bench import common
from track_1_short import config as config_mod
from track_1_short.atomic_io import write_json_atomic
from track_1_short.model.gpt import GPT
from track_1_short.optim.anvil_config import ANVIL, build_param_cfgs
from track_1_short.optim.polar_express import POLAR_EXPRESS_COEFFS, TORCH_PE_GEMMS, polar_express
from track_1_short.perf import profiling

SMOKE_SHAPES = {"qk_bank": (4, 16, 48), "vo_bank": (2, 48, 48), "mlp_bank": (4, 96, 48)}


def bank_shapes(preset: str = "speedrun") -> dict[str, tuple[int, int, int]]:
    """name -> [M, R, C] of every ANVIL bank of the preset's model on one rank (built on the meta
    device: no memory, no init)."""
    with torch.device("meta"):
        model = GPT(config_mod.preset(preset).model)
    cfgs = build_param_cfgs(model.named_parameters())
    return {name: (p[..., 0, 0].numel(), *p.shape[-2:]) for name, p in model.named_parameters()
            if cfgs[p].optim == ANVIL}


def _strategies(device: torch.device, smoke: bool) -> dict:
    """name -> PolarGemms, or the reason it cannot run here."""
    out = {"torch": TORCH_PE_GEMMS}
    if smoke:
        out["quack"] = "--smoke: torch's GEMMs only"
        return out
    from track_1_short.kernels import polar_gemms

    reason = polar_gemms.polar_express_unavailable_reason(device)
    out["quack"] = polar_gemms.QUACK_PE_GEMMS if reason is None else reason
    return out


def _per_call(fn, steps: int, device: torch.device) -> dict:
    """Each of `steps` calls profiled alone: device-busy, kernel and memcpy ms per call
    (summarize), memcpys and kernels per call."""
    busy, kernel, memcpy, copies, kernels = [], [], [], 0, 0
    for _ in range(steps):
        events = common.device_events(lambda _: fn(), 1, device)
        stats = profiling.kernel_stats(events, 1)
        busy.append(stats["device_busy_ms"])
        kernel.append(stats["kernel_ms"])
        mc = [e["dur"] for e in events if e.get("ph") == "X" and e.get("cat") == "gpu_memcpy"]
        memcpy.append(sum(mc) / 1e3)
        copies += len(mc)
        kernels += stats["kernels_per_step"]
    return {"device_busy_ms": common.summarize(busy), "kernel_ms": common.summarize(kernel),
            "memcpy_ms": common.summarize(memcpy), "memcpys_per_call": copies / steps,
            "kernels_per_call": kernels / steps}


def measure(shape, gemms, device: torch.device, args) -> dict:
    """One bank shape, one strategy (module docstring)."""
    gen = torch.Generator(device=device).manual_seed(0)
    g = torch.randn(shape, device=device, generator=gen)  # [M, R, C] fp32, as nesterov_ gives it
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    run = polar_express if args.smoke else torch.compile(polar_express, dynamic=False,
                                                         fullgraph=True)
    fn = lambda: run(g, dtype, POLAR_EXPRESS_COEFFS, gemms)
    for _ in range(args.warmup):
        fn()
    out = {"event_ms": common.time_steps(lambda _: fn(), args.steps, device)}
    if device.type == "cuda":
        out.update(_per_call(fn, args.steps, device))
        out["top_kernels"] = common.device_time_ms(lambda _: fn(), args.steps, device,
                                                   top=8).get("top_kernels")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=20, help="timed (and profiled) calls per row")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls first (compile, JIT)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny banks, torch's GEMMs, eager")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 1:
        p.error(f"--steps {args.steps} and --warmup {args.warmup} must be >= 1")
    device = torch.device("cpu" if args.smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("polar_express: needs a CUDA device (or --smoke); none here", file=sys.stderr)
        return 2
    settings = common.setup_torch(device)
    shapes = SMOKE_SHAPES if args.smoke else bank_shapes()
    result = {"command": common.command(), "machine": common.machine_info(device),
              "settings": {**settings, "steps": args.steps, "warmup": args.warmup,
                           "smoke": args.smoke}, "banks": {}, "complete": False}
    strategies = _strategies(device, args.smoke)
    for name, shape in shapes.items():
        rows = {}
        for label, gemms in strategies.items():
            if isinstance(gemms, str):
                rows[label] = {"unavailable": gemms}
                continue
            errors = {}
            row = common.run_guarded(f"{name}/{label}", lambda: measure(shape, gemms, device, args),
                                     errors)
            rows[label] = row if row is not None else errors[f"{name}/{label}"]
            if row is not None:
                print(f"{name:9s} {str(shape):18s} {label:6s} event "
                      f"{row['event_ms']['median_ms']:8.3f} ms", flush=True)
        busy = [rows[k].get("device_busy_ms", {}).get("median_ms") for k in ("torch", "quack")]
        result["banks"][name] = {"shape": list(shape), "strategies": rows,
                                 "saving_ms": None if None in busy else busy[0] - busy[1]}
        write_json_atomic(args.out, result)
    savings = [b["saving_ms"] for b in result["banks"].values()]
    result["saving_ms_per_even_step"] = None if None in savings else sum(savings)
    result["complete"] = True
    write_json_atomic(args.out, result)
    print(f"saving per even step: {result['saving_ms_per_even_step']} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
