"""Which cuBLAS settings keep the memset nodes out of the captured GEMMs, and what they cost.

Why: the graphs-on step at stage A, one micro-step, was ~96% busy (lease 18's trace,
docs/results/vs_record_h200_2026-12-03_lease18/call5/trace_A_on.json.gz): 120 four-byte memsets
per step, each captured right before a cuBLAS nvjet GEMM (the non-split-K coopA / coopB kernels),
and ~4-6 us of idle device around each, against ~1 us between two kernels elsewhere in the graph.
cuBLAS reads its settings once per process, so each variant (a train.blas setting,
perf/blas_config.py; why: perf/blas.py) runs in a fresh child process.

Per variant and token count T: the step's cuBLAS GEMMs at stage shapes (D = 768, F = 3072): the
attention projections' forward (q/k [2D, D], v and o [D, D]) and both backward GEMMs (dX = g @ W,
dW = g^T @ x), the torch MLP's (up [F, D], down) likewise, and the optimizer's batched Polar
Express GEMMs (gram, gram^2 and x @ poly on 22 tall [F, D] and 44 square [D, D] matrices), all
captured into one CUDA graph. Then 30 replays timed with CUDA events, 3 profiled (memsets per
replay, kernel ms, busy fraction: profiling.kernel_stats), and one eager call of each GEMM profiled
alone (its kernel names and memsets: which GEMMs carry one).
Then the model's narrow gates (five value-embedding gates, x [T, 12] bf16, w [6, 12]; sigmoid and
a weighted sum as the loss), compiled forward + backward captured into one graph per
implementation (GATE_IMPLS): "linear" (F.linear: cuBLAS, whose weight gradient contracts all T
tokens in one GEMM), "product_sum" (a product and a float32 sum, autograd's backward: an inductor
reduction over T) and "narrow_linear" (model/gpt.narrow_linear: the same forward, the weight
gradient as a chunked float32 bmm); 30 replays timed, 3 profiled: replay ms, kernel ms, memsets.

Usage, one H200 (~1-2 min):
    PYTHONPATH=. python bench/gemm_memsets.py --out $OUT/gemm_memsets.json \
        [--tokens 16384,49152] [--variants default,no_workspace] [--choice-env build/gemm_choice.txt]
Output JSON: {command, machine, tokens, variants: {name: {setting, blas, by_tokens: {T: {replay_ms
(summarize), memsets_per_replay, kernel_ms, busy_fraction, ops: {op: {kernels, memsets}},
gates: {impl: {replay_ms, kernel_ms, kernels_per_replay, memsets_per_replay, top (kernels)}}}} |
error}}, choice, complete}. `choice`: the variant with no memset at any T whose replay median is
at most the default's at every T (the fastest such), else null; --choice-env writes it as the --set item
`train.blas=NAME` (an empty file for none), for a later script to pass on.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from bench import common
from track_1_short.atomic_io import write_json_atomic, write_text_atomic
from track_1_short.model.gpt import narrow_linear, narrow_product_sum
from track_1_short.perf import blas, profiling

D, FF = 768, 3072
TALL, SQUARE = 22, 44  # Polar Express batches: the MLP bank's [F, D] matrices, the attention banks'
VARIANTS = tuple(blas.BLAS_SETTINGS)  # train.blas's settings, one child process each
REPLAYS, PROFILED = 30, 3


def gemm_ops(t: int, device: torch.device) -> dict:
    """name -> zero-argument callable: one GEMM of the step at T tokens (bf16, random inputs)."""
    g = torch.Generator(device=device).manual_seed(0)
    r = lambda *shape: torch.randn(*shape, device=device, dtype=torch.bfloat16, generator=g)
    x, x_f = r(t, D), r(t, FF)
    ops = {}
    for name, n, k in (("qk", 2 * D, D), ("v_o", D, D), ("mlp_up", FF, D), ("mlp_down", D, FF)):
        w, grad, inp = r(n, k), r(t, n), (x_f if k == FF else x)
        ops[f"{name}_fwd"] = lambda inp=inp, w=w: F.linear(inp, w)  # [T, k] @ [k, n]
        ops[f"{name}_dx"] = lambda grad=grad, w=w: grad @ w  # [T, n] @ [n, k]
        ops[f"{name}_dw"] = lambda grad=grad, inp=inp: grad.t() @ inp  # [n, T] @ [T, k]
    tall, square = r(TALL, FF, D) * 0.02, r(SQUARE, D, D) * 0.02
    gram_t, gram_s = tall.mT @ tall, square @ square.mT  # [B, D, D]
    ops["pe_gram_tall"] = lambda: tall.mT @ tall
    ops["pe_poly_tall"] = lambda: torch.baddbmm(gram_t, gram_t, gram_t, beta=-4.0, alpha=1.5)
    ops["pe_update_tall"] = lambda: torch.baddbmm(tall, tall, gram_t, beta=3.0)
    ops["pe_gram_square"] = lambda: square @ square.mT
    ops["pe_poly_square"] = lambda: torch.baddbmm(gram_s, gram_s, gram_s, beta=-4.0, alpha=1.5)
    ops["pe_update_square"] = lambda: torch.baddbmm(square, gram_s, square, beta=3.0)
    return ops


GATES, GATE_K, GATE_N = 5, 12, 6  # value-embedding gates per micro-step, their [N, K] weights
GATE_IMPLS = {
    "linear": F.linear,
    "product_sum": narrow_product_sum,
    "narrow_linear": narrow_linear,
}


def gate_step(impl: str, t: int, device: torch.device):
    """A zero-argument callable: the five gates' compiled forward and backward at T tokens under
    GATE_IMPLS[impl] (inputs made here, gradients returned)."""
    g = torch.Generator(device=device).manual_seed(1)
    r = lambda *shape: torch.randn(*shape, device=device, generator=g)
    xs = [r(t, GATE_K).to(torch.bfloat16).requires_grad_() for _ in range(GATES)]
    ws = [(r(GATE_N, GATE_K) * 0.1).requires_grad_() for _ in range(GATES)]  # float32 params
    us = [r(t, GATE_N).to(torch.bfloat16) for _ in range(GATES)]
    fn = GATE_IMPLS[impl]

    @torch.compile(fullgraph=True, dynamic=False)
    def loss_of(xs, ws):
        return sum((torch.sigmoid(fn(x, w.to(x.dtype))) * u).float().sum() for x, w, u in zip(xs, ws, us))

    return lambda: torch.autograd.grad(loss_of(xs, ws), xs + ws)


def _captured(fns, device: torch.device):
    """fns (zero-argument callables) captured into one CUDA graph after two eager calls each; its
    replay (the outputs live in the graph's pool)."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:
            fn(), fn()
        with torch.cuda.graph(graph, stream=stream):
            keep = [fn() for fn in fns]  # noqa: F841 - outputs live in the graph's pool
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(5):
        graph.replay()
    return graph.replay


def measure_gates(t: int, device: torch.device) -> dict:
    """Each GATE_IMPLS entry's captured forward + backward of the five gates at T tokens."""
    out = {}
    for impl in GATE_IMPLS:
        replay = _captured([gate_step(impl, t, device)], device)
        times = common.time_steps(lambda _: replay(), REPLAYS, device)
        events = common.device_events(lambda _: replay(), PROFILED, device)
        stats = profiling.kernel_stats(events, PROFILED, top=6)
        out[impl] = {"replay_ms": times, "kernel_ms": stats["kernel_ms"],
                     "kernels_per_replay": stats["kernels_per_step"],
                     "memsets_per_replay": _memsets(events) / PROFILED, "top": stats["top_kernels"]}
    return out


def _memsets(events: list[dict]) -> int:
    return sum(1 for e in events if e.get("ph") == "X" and e.get("cat") == "gpu_memset")


def measure(t: int, device: torch.device) -> dict:
    """One token count in this process: per-op kernels and memsets, then the captured graph."""
    ops = gemm_ops(t, device)
    for fn in ops.values():  # cuBLAS picks and caches its kernels before the capture
        fn(), fn()
    per_op = {}
    for name, fn in ops.items():
        events = common.device_events(lambda _, fn=fn: fn(), 1, device)
        per_op[name] = {"kernels": sorted({e["name"][:120] for e in events
                                           if e.get("ph") == "X" and e.get("cat") == "kernel"}),
                        "memsets": _memsets(events)}
    replay = _captured(list(ops.values()), device)
    times = common.time_steps(lambda _: replay(), REPLAYS, device)
    events = common.device_events(lambda _: replay(), PROFILED, device)
    stats = profiling.kernel_stats(events, PROFILED)
    return {"replay_ms": times, "memsets_per_replay": _memsets(events) / PROFILED,
            "kernel_ms": stats["kernel_ms"], "busy_fraction": stats["busy_fraction"],
            "kernels_per_replay": stats["kernels_per_step"], "ops": per_op,
            "gates": measure_gates(t, device)}


def child(args) -> int:
    """--child NAME: measure every --tokens under train.blas=NAME in this process (fresh: the
    setting goes in before the first CUDA call), JSON on stdout's last line."""
    with blas.applied(args.child, flag="--child"):
        device = torch.device("cuda", 0)  # set_device refuses "cuda" without an index
        torch.cuda.set_device(device)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]):
            torch.ones(1, device=device).add_(1)  # CUPTI up before the capture (bench/common.setup_torch)
        out = {"blas": str(torch.backends.cuda.preferred_blas_library()),
               "by_tokens": {str(t): measure(t, device) for t in args.tokens}}
    print(json.dumps(out))
    return 0


def choose(variants: dict, tokens: list[int]) -> str | None:
    """The fastest variant with no memset at any T and a replay median <= the default's at every T."""
    base = variants.get("default", {}).get("by_tokens")
    if not base:
        return None
    ok = []
    for name, v in variants.items():
        rows = v.get("by_tokens")
        if name == "default" or not rows:
            continue
        if all(rows[str(t)]["memsets_per_replay"] == 0
               and rows[str(t)]["replay_ms"]["median_ms"] <= base[str(t)]["replay_ms"]["median_ms"]
               for t in tokens):
            ok.append((sum(rows[str(t)]["replay_ms"]["median_ms"] for t in tokens), name))
    return min(ok)[1] if ok else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tokens", default="16384,49152", help="token counts T (stage A: 16384, C: 49152)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    p.add_argument("--choice-env", type=Path, help="write the chosen variant's --set item here")
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        args.tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        p.error(f"--tokens {args.tokens!r}: comma-separated integers, e.g. 16384,49152")
    if any(t <= 0 for t in args.tokens):
        p.error(f"--tokens {args.tokens}: each must be > 0")
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    if args.child is not None:
        return child(args)
    if not torch.cuda.is_available():
        print("gemm_memsets: needs a CUDA device (cuBLAS); none here", file=sys.stderr)
        return 2
    result = {"command": common.command(), "machine": common.machine_info(torch.device("cuda")),
              "tokens": args.tokens, "variants": {}, "choice": None, "complete": False}
    for name in names:
        # "default" is torch's own: no workspace variable inherited from this environment
        env = {k: v for k, v in os.environ.items() if k not in blas.WORKSPACE_ENV}
        proc = subprocess.run([sys.executable, __file__, "--child", name, "--out", str(args.out),
                               "--tokens", ",".join(map(str, args.tokens))],
                              env=env, capture_output=True, text=True, timeout=300)
        row = {"setting": blas.describe(name)}
        if proc.returncode == 0:
            row.update(json.loads(proc.stdout.strip().splitlines()[-1]))
            for t, v in row["by_tokens"].items():
                print(f"{name:11s} T={t:6s} replay {v['replay_ms']['median_ms']:8.3f} ms  memsets "
                      f"{v['memsets_per_replay']:5.1f}  busy {v['busy_fraction']:.4f}", flush=True)
                for impl, gv in v["gates"].items():
                    print(f"    gates {impl:13s} replay {gv['replay_ms']['median_ms']:7.3f} ms  kernel "
                          f"{gv['kernel_ms']:7.3f} ms  kernels {gv['kernels_per_replay']:4.0f}  "
                          f"memsets {gv['memsets_per_replay']:4.1f}", flush=True)
        else:
            row["error"] = (proc.stderr or proc.stdout)[-3000:]
            print(f"{name}: FAILED\n{row['error']}", flush=True)
        result["variants"][name] = row
        write_json_atomic(args.out, result)
    result["choice"] = choose(result["variants"], args.tokens)
    result["complete"] = True
    write_json_atomic(args.out, result)
    print(f"choice: {result['choice']}")
    if args.choice_env is not None:  # the --set item a later script passes on
        write_text_atomic(args.choice_env, f"train.blas={result['choice']}\n" if result["choice"] else "")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
