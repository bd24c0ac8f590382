"""Benchmark of AnvilAndAdam.step on the trainer's model, compiled and eager, as JSON.

What it measures, per compile mode (--compile off,on: AnvilConfig.compile False / True, same process,
one optimizer at a time over the same model):
- step_ms.even / step_ms.odd: wall time of `optimizer.step(step, lr_scale, momentum, adam_step)`
  from CUDA events around each call (perf_counter on CPU), separately for even steps (ANVIL banks
  only) and odd steps (banks + Adam: the preset schedule's plan.adam_step), median and spread over --steps timed steps after --warmup untimed ones (the compiled
  mode compiles during the warmup: it spans an even and an odd step);
- unit_ms: each unit of work alone, no comms: every bank's anvil_bank_step_ on this rank's shard,
  every table's adam_step_, the small-parameter group's adam_group_step_ and, while tied, the
  gradient fold (tied_fold) and the weight copy (tied_copy);
- compiles: dynamo graphs compiled during the warmup and during the timed steps (must be 0: the
  per-step values are tensor inputs, so changing lr / momentum recompiles nothing);
- with world size > 1: the collectives of an even and of an odd step alone (no math), and how much
  of the even step's communication the math hides (an estimate from medians).
Gradients are random, in persistent buffers assigned to p.grad before each step (as the step graphs
hand them over) and, for value_embeds, copied into ValueEmbedPull.grad_accum, outside the timed
region; lr_scale and momentum change every step.

Model: the trainer's (bench.common.build_bench_model: speedrun GPTConfig, bf16 banks / embeddings /
head on CUDA), so the shapes are the per-rank shapes the trainer steps (world size 1: qk_bank
[64, 256, 768], vo_bank [24, 768, 768], mlp_bank [12, 2, 3072, 768] = 24 matrices, embed
[50304, 768], lm_head [768, 50304], value_embeds [251520, 768], the small Adam parameters);
embed/lm_head tied (stages A-B) unless --untied (stage C onwards). The optimizer is built as
trainer/build.py's build_optimizer builds it (plus parameter names).

Run (H200, stage C shapes; compile of the 7 graphs ~1 min):
    PYTHONPATH=. python bench/optimizer.py --untied --out docs/results/optimizer_h200_1gpu.json
Run (H200, Polar Express on quack's GEMMs, kernels/polar_gemms.py): add --polar-gemms quack.
Run (2 GPUs):
    PYTHONPATH=. torchrun --standalone --nproc_per_node 2 bench/optimizer.py --untied \
        --out docs/results/optimizer_h200_2gpu.json
Smoke (CPU, tiny model, the compiled mode on the aot_eager backend):
    PYTHONPATH=. python bench/optimizer.py --smoke --out /tmp/opt.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bench import common
from track_1_short.distributed import destroy_distributed, init_distributed
from track_1_short.optim.anvil import AnvilAndAdam, _reduce_scatter, build_param_cfgs
from track_1_short.optim.anvil_config import POLAR_GEMMS
from track_1_short.perf import compile_cache
from track_1_short.schedule import Schedule
from track_1_short.trainer.build import resolve_polar_gemms

MODES = {"off": False, "on": True}


class Timer:
    """ms of one call: CUDA events on GPU (the caller's stream), perf_counter on CPU."""

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
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, aot_eager compile")
    ap.add_argument("--compile", default="off,on", help="modes to run, in order: off, on or off,on")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per mode (half even, half odd)")
    ap.add_argument("--warmup", type=int, default=6, help="untimed steps per mode (compile happens here)")
    ap.add_argument("--untied", action="store_true", help="embed and lm_head untied (stage C on)")
    ap.add_argument("--polar-gemms", choices=POLAR_GEMMS, default="torch",
                    help="Polar Express's GEMMs (optim.polar_gemms): torch or quack")
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.compile.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes) or args.warmup < 2 or args.steps < 2:
        raise SystemExit(f"--compile {args.compile!r}: off, on or off,on; --warmup and --steps >= 2")

    ctx = init_distributed(timeout_s=300, device_type="cpu" if args.smoke else "cuda")
    device = ctx.device
    settings = common.setup_torch(device)
    cfg, model = common.build_bench_model(args.smoke, device, attention=None, fp8=None)
    header = dict(settings=settings, world_size=ctx.world_size, backend=ctx.backend,
                  untied=args.untied, polar_gemms=args.polar_gemms, smoke=args.smoke,
                  warmup=args.warmup, steps=args.steps,
                  shapes={n: list(p.shape) for n, p in model.named_parameters()},
                  dtypes={n: str(p.dtype) for n, p in model.named_parameters()}, modes={}, errors={})
    # rank 0 writes the JSON (every rank measures: the collectives need them all)
    results = common.Results(Path(args.out), device, **header) if ctx.is_main else None
    data = results.data if results is not None else header
    grads = {p: torch.randn_like(p) for p in model.parameters()}  # persistent "graph buffers"
    schedule = Schedule(cfg.schedule)  # the cadence: plan(step).adam_step
    for mode in modes:
        cfg.optim = dataclasses.replace(cfg.optim, compile=MODES[mode],
                                        compile_backend="aot_eager" if args.smoke else "inductor",
                                        polar_gemms=args.polar_gemms)
        opt = build_optimizer(cfg, model)
        if args.untied:
            opt.untie_embed_head()  # as the trainer does at stage C's first step (zero state here)
        row = common.run_guarded(mode, lambda o=opt: bench_mode(o, model, grads, schedule, args, ctx),
                                 data["errors"])
        if row is not None:
            data["modes"][mode] = {"compiled": opt.compiled, **row}
        if results is not None:
            results.save()
        del opt
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    done = data["modes"]
    if {"off", "on"} <= set(done):
        data["compiled_over_eager"] = {
            k: done["on"]["step_ms"][k]["median_ms"] / done["off"]["step_ms"][k]["median_ms"]
            for k in ("even", "odd")}
    data["complete"] = not data["errors"]
    if results is not None:
        results.save()
        print(json.dumps({m: {k: r["step_ms"][k]["median_ms"] for k in ("even", "odd")}
                          for m, r in done.items()}, indent=2))
    destroy_distributed()


def build_optimizer(cfg, model) -> AnvilAndAdam:
    """As trainer/build.py's build_optimizer builds it (tied embed/lm_head, value_embeds' gradient buffer,
    Polar Express's GEMMs from optim.polar_gemms), with the parameters' names, which the JSON's
    unit rows are keyed by."""
    opt = AnvilAndAdam(build_param_cfgs(model.named_parameters()), cfg.optim,
                       names={p: n for n, p in model.named_parameters()},
                       tied_embed_head=(model.embed.weight, model.lm_head),
                       polar_gemms=resolve_polar_gemms(cfg.optim.polar_gemms,
                                                       model.lm_head.device))
    opt.set_grad_buffer(model.value_embeds.weight, model.value_embeds.grad_accum)
    return opt


def bench_mode(opt: AnvilAndAdam, model, grads: dict, schedule: Schedule, args, ctx) -> dict:
    """One compile mode: warmup, timed steps, units alone, comms alone (world size > 1)."""
    timer = Timer(ctx.device)
    ve, grad_accum = model.value_embeds.weight, model.value_embeds.grad_accum

    def fill():
        for p, g in grads.items():
            if p is ve:
                grad_accum.copy_(g)
            elif p.grad is None:
                p.grad = g
        common.sync(ctx.device)

    times, compiles = {"even": [], "odd": []}, {}
    before = compile_cache.graphs_compiled()
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            compiles["warmup"] = compile_cache.graphs_compiled() - before
            before = compile_cache.graphs_compiled()
        fill()
        lr_scale, momentum = 1.0 - 0.01 * step, 0.85 + 0.002 * step  # changing values: no recompile
        adam_step = schedule.plan(step).adam_step
        ms = timer(lambda: opt.step(step, lr_scale, momentum, adam_step))
        if step >= args.warmup:
            times["odd" if adam_step else "even"].append(ms)
    compiles["timed"] = compile_cache.graphs_compiled() - before
    step_ms = {k: common.summarize(v) for k, v in times.items()}
    row = dict(step_ms=step_ms, compiles=compiles, unit_ms=measure_units(opt, timer, args.steps))
    if ctx.world_size > 1:
        comm_even = measure_comms(opt, timer, args.steps, adam=False)
        row.update(comm_only_odd_step_ms=measure_comms(opt, timer, args.steps, adam=True),
                   comm_only_even_step_ms=comm_even,
                   comm_hidden_even_step=hidden_comm(step_ms["even"], comm_even, row["unit_ms"]))
    opt.reset()
    return row


@torch.no_grad()  # as in step(): dynamo guards on the grad mode (a second graph per unit otherwise)
def measure_units(opt: AnvilAndAdam, timer: Timer, reps: int) -> dict:
    """Every unit's update alone on this rank's shard (random gradients, no comms)."""
    def timed(fn, shape) -> dict:
        fn()  # compiled: the graph exists already (the warmup ran it); eager: first-call costs
        return dict(shard=list(shape), **common.summarize([timer(fn) for _ in range(reps)]))

    out = {}
    for b in opt.banks:
        g = torch.randn_like(b.momentum).to(b.view.dtype)
        out[b.name] = timed(lambda: opt._update_bank(b, g), b.momentum.shape)
    for a in opt.adam_tables:
        if opt.tied and a is opt.tied[0]:
            continue  # the tied embed is not updated (lm_head carries its gradient)
        # replicated: the update reads the grad buffer itself (and zeroes it in the same pass)
        g = opt.grad_buffers.get(a.param) if not a.sharded else None
        if g is None:
            g = torch.randn_like(a.exp_avg).to(a.grad.dtype if a.grad is not None else a.param.dtype)
        out[a.name] = timed(lambda: opt._update_table(a, g), a.exp_avg.shape)
    if opt.adam_group:
        gs = [torch.randn_like(a.exp_avg).to(a.param.dtype) for a in opt.adam_group]
        out["adam_group"] = timed(lambda: opt._update_group(gs), [len(gs)])
    if opt.tied:
        embed, head = opt.tied
        # the fold of an Adam step and the copy after it (the grad buffer's zeroing included)
        head_grad = torch.randn(head.param.shape, device=head.param.device)
        embed_grad = opt.grad_buffers.get(embed.param)
        if embed_grad is None:
            embed_grad = torch.randn(embed.param.shape, device=head_grad.device)
        out["tied_fold"] = timed(lambda: opt._fold_tied_grad(head_grad, embed_grad, True),
                                 head_grad.shape)
        out["tied_copy"] = timed(lambda: opt._copy_transposed(embed.param.data, head.param.data),
                                 embed.param.shape)
    return out


def measure_comms(opt: AnvilAndAdam, timer: Timer, reps: int, adam: bool) -> dict:
    """The collectives of one step alone, launched in the optimizer's order, then waited: an odd
    step's (banks + Adam) with adam=True, an even step's (banks only) with adam=False."""
    avg = dist.ReduceOp.AVG
    adam_units = opt.adam_group + opt.adam_tables if adam else []

    def run():
        works = [_reduce_scatter(b.grad, b.view, op=avg, group=opt.group, async_op=True)
                 for b in opt.banks]
        for a in adam_units:
            if a.sharded:
                src = a.grad_in if a.grad_in is not None else a.param.data
                works.append(_reduce_scatter(a.grad, src, op=avg, group=opt.group, async_op=True))
            else:
                works.append(dist.all_reduce(a.exp_avg.clone(), group=opt.group, async_op=True))
        for a in adam_units:
            if a.sharded:
                works.append(dist.all_gather_into_tensor(a.target, a.shard, group=opt.group,
                                                         async_op=True))
        for b in opt.banks:
            works.append(dist.all_gather_into_tensor(b.view, b.shard, group=opt.group, async_op=True))
        for w in works:
            w.wait()

    for _ in range(3):
        run()
    return common.summarize([timer(run) for _ in range(reps)])


def hidden_comm(step: dict, comm: dict, units: dict) -> dict:
    """How much of an even (ANVIL-only) step's communication overlaps its math, from medians:
    hidden = comm + math - step (clipped to [0, comm]); math = the banks' unit times summed.
    An estimate: it assumes comm and math cost the same overlapped as alone."""
    math_ms = sum(row["median_ms"] for name, row in units.items() if name.endswith("_bank"))
    hidden = min(max(comm["median_ms"] + math_ms - step["median_ms"], 0.0), comm["median_ms"])
    return dict(formula="hidden = clip(comm_only + sum(bank units) - step, 0, comm_only), medians",
                step_ms=step["median_ms"], comm_only_ms=comm["median_ms"], math_ms=math_ms,
                hidden_ms=hidden, exposed_ms=comm["median_ms"] - hidden,
                hidden_fraction=hidden / comm["median_ms"] if comm["median_ms"] else None)


if __name__ == "__main__":
    main()
