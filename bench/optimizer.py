"""Benchmark of AnvilAndAdam.step at the speedrun's parameter shapes (facts 1.1), as JSON.

What it measures: wall time of `optimizer.step(step, lr_scale)` with CUDA events, separately for
even steps (ANVIL banks only) and odd steps (banks + Adam), median and spread over --steps timed
steps after --warmup; the time of the same collectives alone (what one odd step sends, no math);
and the ANVIL math alone per bank (momentum, Polar Express, NorMuon, update; no comms).
Gradients are random, written into persistent buffers before each step (as the step graphs do),
outside the timed region.

Run (H200):      PYTHONPATH=. python bench/optimizer.py --out docs/results/optimizer_1gpu.json
Run (2 GPUs):    PYTHONPATH=. torchrun --nproc_per_node 2 bench/optimizer.py --out docs/results/optimizer_2gpu.json
Smoke test (CPU): PYTHONPATH=. python bench/optimizer.py --device cpu --tiny --out /tmp/opt.json

Shapes: qk_bank 64x256x768, vo_bank 24x768x768, mlp_bank 12x2x3072x768, embed 50304x768, lm_head
768x50304 (tied to embed unless --untied), value_embeds 251520x768 (gradient through
set_grad_buffer), and the small Adam params of facts 4.2. bf16 parameters (fp32 masters).
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from bench.common import command
from track_1_short.distributed import destroy_distributed, init_distributed
from track_1_short.optim.anvil import AnvilAndAdam, AnvilConfig, build_param_cfgs
from track_1_short.report import write_json_atomic

FULL = dict(dim=768, vocab=50304, qk=64, vo=24, mlp=12, hidden=3072, ve_rows=5 * 50304)
TINY = dict(dim=64, vocab=512, qk=8, vo=8, mlp=4, hidden=256, ve_rows=5 * 512)


class Shapes(nn.Module):
    """The trainer's optimizer-visible parameters, by name, without a forward."""

    def __init__(self, s: dict, dtype: torch.dtype, device: torch.device):
        super().__init__()
        p = lambda *shape: nn.Parameter(torch.randn(*shape, device=device).mul_(0.02).to(dtype))
        d = s["dim"]
        self.qk_bank = p(s["qk"], 256 if d == 768 else d // 2, d)
        self.vo_bank = p(s["vo"], d, d)
        self.mlp_bank = p(s["mlp"], 2, s["hidden"], d)
        self.lm_head = p(d, s["vocab"])
        self.embed = nn.Embedding(s["vocab"], d)
        self.embed.weight = nn.Parameter(self.lm_head.data.T.contiguous())
        self.value_embeds = nn.Embedding(s["ve_rows"], d)
        self.value_embeds.weight = p(s["ve_rows"], d)
        self.scalars = p(24)
        self.smear_gate = p(1, 12)
        self.ve_gate_bank = p(5, 6, 12)
        self.post_lambdas = p(11, 2)
        self.resid_lambdas = p(11, 2)


def stats_ms(xs: list[float]) -> dict:
    xs = sorted(xs)
    q = lambda f: xs[min(len(xs) - 1, int(f * len(xs)))]
    return dict(median=statistics.median(xs), min=xs[0], p10=q(0.1), p90=q(0.9), max=xs[-1], n=len(xs))


class Timer:
    """CUDA events on GPU, perf_counter on CPU; ms."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="small shapes (CPU smoke test)")
    ap.add_argument("--steps", type=int, default=30, help="timed steps (half even, half odd)")
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--compile", action="store_true", help="AnvilConfig.compile")
    ap.add_argument("--untied", action="store_true", help="embed and lm_head untied (stage C)")
    args = ap.parse_args(argv)

    if args.compile:
        # one compiled graph per distinct shard shape and beta pair (~16); dynamo's default is 8
        torch._dynamo.config.recompile_limit = 64
    ctx = init_distributed(timeout_s=300, device_type=args.device)
    device = ctx.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = Shapes(TINY if args.tiny else FULL, dtype, device)
    names = {p: n for n, p in model.named_parameters()}
    opt = AnvilAndAdam(build_param_cfgs(model.named_parameters()), AnvilConfig(compile=args.compile),
                       names=names,
                       tied_embed_head=None if args.untied else (model.embed.weight, model.lm_head))
    ve = model.value_embeds.weight
    grads = {p: torch.randn_like(p) for p in model.parameters()}  # persistent "graph buffers"
    grad_accum = torch.zeros_like(ve)
    opt.set_grad_buffer(ve, grad_accum)
    timer = Timer(device)

    def fill(step: int):
        for p, g in grads.items():
            if p is ve:
                grad_accum.copy_(g)
            elif p.grad is None:
                p.grad = g
        if device.type == "cuda":
            torch.cuda.synchronize()

    times = {"even": [], "odd": []}
    for step in range(args.warmup + args.steps):
        fill(step)
        ms = timer(lambda: opt.step(step, lr_scale=1.0))
        if step >= args.warmup:
            times["odd" if opt.adam_step_due(step) else "even"].append(ms)

    comm_ms = measure_comms(opt, timer, args.steps) if ctx.world_size > 1 else None
    comm_even_ms = measure_comms(opt, timer, args.steps, adam=False) if ctx.world_size > 1 else None
    math_ms = measure_anvil_math(opt, timer, args.steps)
    step_ms = {k: stats_ms(v) for k, v in times.items() if v}
    result = dict(
        command=command(),
        machine=dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                     torch=torch.__version__, cuda=torch.version.cuda, world_size=ctx.world_size,
                     backend=ctx.backend),
        shapes={n: list(p.shape) for n, p in model.named_parameters()},
        config=dict(tiny=args.tiny, compile=args.compile, tied=not args.untied, dtype=str(dtype),
                    warmup=args.warmup, steps=args.steps),
        step_ms=step_ms,
        comm_only_odd_step_ms=comm_ms,
        comm_only_even_step_ms=comm_even_ms,
        anvil_math_ms=math_ms,
        comm_hidden_even_step=hidden_comm(step_ms.get("even"), comm_even_ms, math_ms),
    )
    if ctx.is_main:
        write_json_atomic(Path(args.out), result)
        print(json.dumps(result["step_ms"], indent=2))
    destroy_distributed()


def measure_comms(opt: AnvilAndAdam, timer: Timer, reps: int, adam: bool = True) -> dict:
    """The collectives of one step alone, launched in the optimizer's order, then waited: an odd
    step's (banks + Adam) with adam=True, an even step's (banks only) with adam=False."""
    import torch.distributed as dist
    from track_1_short.optim.anvil import _reduce_scatter

    def run():
        works = [_reduce_scatter(b.grad, b.view, op=dist.ReduceOp.AVG, group=opt.group, async_op=True)
                 for b in opt.banks]
        for a in (opt.adam_order if adam else ()):
            if a.sharded:
                src = a.grad_in if a.grad_in is not None else a.param.data
                works.append(_reduce_scatter(a.grad, src, op=dist.ReduceOp.AVG, group=opt.group,
                                             async_op=True))
            else:
                works.append(dist.all_reduce(a.exp_avg.clone(), group=opt.group, async_op=True))
        for a in (opt.adam_order if adam else ()):
            if a.sharded:
                works.append(dist.all_gather_into_tensor(a.target, a.shard, group=opt.group, async_op=True))
        for b in opt.banks:
            works.append(dist.all_gather_into_tensor(b.view, b.shard, group=opt.group, async_op=True))
        for w in works:
            w.wait()

    for _ in range(3):
        run()
    return stats_ms([timer(run) for _ in range(reps)])


def hidden_comm(step: dict | None, comm: dict | None, math: dict) -> dict | None:
    """How much of an even (ANVIL-only) step's communication overlaps its math, from medians:
    hidden = comm + math - step (clipped to [0, comm]); math = the per-bank shard math summed.
    An estimate: it assumes comm and math cost the same overlapped as alone."""
    if step is None or comm is None:
        return None
    math_ms = sum(bank["median"] for bank in math.values())
    hidden = min(max(comm["median"] + math_ms - step["median"], 0.0), comm["median"])
    return dict(formula="hidden = clip(comm_only + sum(anvil_math) - step, 0, comm_only), medians",
                step_ms=step["median"], comm_only_ms=comm["median"], math_ms=math_ms,
                hidden_ms=hidden, hidden_fraction=hidden / comm["median"] if comm["median"] else None,
                exposed_ms=comm["median"] - hidden)


def measure_anvil_math(opt: AnvilAndAdam, timer: Timer, reps: int) -> dict:
    """Per bank: momentum + Polar Express + NorMuon + update on this rank's shard, no comms."""
    out = {}
    for b in opt.banks:
        grad = torch.randn_like(b.momentum).to(b.view.dtype)

        def run():
            v = opt._nesterov(b.momentum, grad, torch.tensor(0.95, dtype=torch.float64))
            v = opt._polar_express(v, opt._ortho_dtype(b), opt.coeffs).float()
            v = opt._normuon(v, b.second_moment, opt.cfg.beta2)
            target = b.master if b.master is not None else b.shard
            opt._anvil_update(target, v, b.lr_mul * 1e-3, torch.tensor(1e-3, dtype=torch.float64))

        run()
        out[b.name] = dict(shard=list(b.momentum.shape), **stats_ms([timer(run) for _ in range(reps)]))
    opt.reset()
    return out


if __name__ == "__main__":
    main()
