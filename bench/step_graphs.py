"""Step-graph benchmark: the training step with CUDA graphs vs eager vs reduce-overhead, as JSON.

What it measures, per key (speedrun keys A-D at per-rank shapes, plus A_half: stage A at 8,192
tokens, the 16-GPU regime where the host dominates), in ONE process on one GPU:
- variants, each driving forward + backward + gradient handoff (the optimizer step is not timed;
  its zero_grad, host-only, runs after every step as in the trainer):
    eager            EagerStep (make_step_runner, --graphs off): the compiled model launched eagerly
    graphs           StepGraphs (make_step_runner, --graphs on), the project's captured step
    reduce-overhead  torch.compile(model, mode="reduce-overhead", fullgraph=True, dynamic=False),
                     cudagraph_mark_step_begin() + training_loss + loss_grads + GradHandoff
  Runners use a real AnvilAndAdam for param_cfgs (world size 1, micro_steps 1) and a step_keys
  list with 2 steps per key, whose cadences are the preset schedule's plans of those step numbers
  (an Adam window's copy and add; the n-gram gradient's accumulation into the store is not in
  this bench: bench/step.py times it in the real step). Graphs: every key is visited twice (capture, then self-check), then seal().
- wall ms per step = host time over --steps steps with a synchronize at both ends / steps (what
  the user sees); median / p10 / p90 from CUDA events at step boundaries;
- kernel ms per step from a torch.profiler run of another --steps steps (CUDA activity: summed
  kernel durations / steps, and the union of kernel+memcpy+memset time); gpu_busy = union / wall
  and kernel ms / wall;
- peak memory (max allocated / reserved, reset before each unit; eager runs first so its peak has
  no graph pool in it), memory reserved with every key captured, recompiles in timed loops,
  compile seconds, StepGraphs.capture_report().
Goals (booleans computed from the numbers): graphs <= eager at every key; graphs GPU busy >= 99%
and wall within 2% of summed kernel time at every key; graphs <= 0.7x eager at A_half; reserved
memory with all keys captured <= 1.3x the eager peak. A failing unit is recorded as an error and
the rest still run; the JSON is rewritten after every unit (so --budget-s or a kill leaves it).

Run (H200; compile dominates: ~90 s first key, ~60-80 s per further key and per compile mode,
so eager + graphs over 5 keys is ~8 min; reduce-overhead recompiles every key):
    PYTHONPATH=. python bench/step_graphs.py --variants eager,graphs --budget-s 450 \
        --also-model-json docs/results/model_h200.json --out docs/results/step_graphs_h200.json
    then, on the same warm machine (build/inductor_cache makes eager/graphs compiles cheap), all
    three side by side: PYTHONPATH=. python bench/step_graphs.py --keys A,C --budget-s 450 \
        --out docs/results/step_graphs_ro_h200.json
Smoke (CPU: tiny config, RecordingGraphBackend stand-in for graphs, no profiler, no
reduce-overhead): PYTHONPATH=. python bench/step_graphs.py --smoke --out /tmp/sg.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from bench import common
from bench import model as model_bench
from track_1_short.optim.anvil import AnvilAndAdam, build_param_cfgs
from track_1_short.perf.cuda_graphs.capture_plan import StepGraphKey
from track_1_short.perf.cuda_graphs.capture_support import RecordingGraphBackend, loss_grads
from track_1_short.perf.cuda_graphs.step_graphs import (GradHandoff, StepGraphsConfig, live_key,
                                                        make_step_runner, training_loss)
from track_1_short.perf.ngram_store import NgramStore
from track_1_short.schedule import Schedule

VARIANTS = ("eager", "graphs", "reduce-overhead")  # run order (eager first: clean peak memory)
STEPS_PER_KEY = 2  # step_keys entries per key: an Adam window opened, then added to (speedrun plan)
WARM_STEPS = 2  # untimed steps before each timed loop (after compile / capture)


class StepBench:
    """Everything the variants share: model, optimizer, per-key batches, step numbering."""

    def __init__(self, args, device: torch.device):
        self.args, self.device = args, device
        self.cfg, self.model = common.build_bench_model(args.smoke, device, args.attention,
                                                        args.fp8)
        m = self.model
        self.optimizer = AnvilAndAdam(build_param_cfgs(m.named_parameters()), self.cfg.optim,
                                      tied_embed_head=(m.embed.weight, m.lm_head))
        self.optimizer.set_grad_buffer(m.value_embeds.weight, m.value_embeds.grad_accum)
        self.compiled = m if args.smoke else torch.compile(m, fullgraph=True, dynamic=False)
        self.specs = common.select_specs(args.keys, args.smoke, args.half_key)
        self.inputs, self.fwd_cfg, self.first_step, self.step_keys = {}, {}, {}, []
        # fills the lookup's row cache (a zero table)
        self.store = store = NgramStore(m.ngram_table, cycle=self.cfg.schedule.ngram_cycle,
                                        micro_steps=1)
        for spec in self.specs:
            cfg = common.forward_config(spec, device)
            batches = [common.model_batch(spec, m, device, seed=s) for s in (1, 2)]
            # slots outside the timed loop: the step measured is forward + backward + handoff
            self.inputs[spec.name] = [(b, store.slots_for(b.inputs), pieces)
                                      for b, pieces in batches]
            self.fwd_cfg[spec.name] = cfg
            self.first_step[spec.name] = len(self.step_keys)
            self.step_keys += [live_key(batches[0][0], cfg)] * STEPS_PER_KEY
        self.schedule = Schedule(self.cfg.schedule)  # the cadences of the bench's step numbers
        self.plans = [self.schedule.plan(step) for step in range(len(self.step_keys))]
        self.static_gib = common.memory_gib(device)["reserved_gib"]

    def runner(self, mode: str):
        return make_step_runner(
            StepGraphsConfig(mode=mode, warm_iterations=1 if self.args.smoke else 3),
            model=self.compiled, optimizer=self.optimizer, step_keys=self.step_keys,
            ngram_table=self.model.ngram_table, value_embeds=self.model.value_embeds,
            max_step_tokens=max(k.tokens for k in self.step_keys), plans=self.plans,
            micro_steps=1, device=self.device,
            backend=RecordingGraphBackend() if self.args.smoke else None)

    def _step_of(self, spec, i: int) -> int:
        return self.first_step[spec.name] + i % STEPS_PER_KEY

    def runner_step(self, runner, spec):
        """One training micro-step through a StepGraphs/EagerStep runner, as trainer/step.py's train_step."""
        def fn(i: int):
            step = self._step_of(spec, i)
            batch, slots, _ = self.inputs[spec.name][i % 2]
            plan = self.plans[step]
            runner.forward(step, batch, slots, self.fwd_cfg[spec.name])
            runner.backward()
            self.optimizer.zero_grad(plan.adam_step)  # host-only: drops p.grad as optimizer.step ends
        return fn

    def reduce_overhead_step(self, compiled, handoff: GradHandoff, spec):
        params = list(self.optimizer.param_cfgs)
        m = self.model

        def fn(i: int):
            step = self._step_of(spec, i)
            batch, slots, _ = self.inputs[spec.name][i % 2]
            torch.compiler.cudagraph_mark_step_begin()
            sink = m.ngram_table.grad_sink(spec.tokens)
            loss = training_loss(compiled, batch.inputs, batch.targets, batch.cum_seqlens, slots,
                                 self.fwd_cfg[spec.name], sink, m.value_embeds.grad_accum)
            grads = loss_grads(loss, params + [sink])
            handoff.hand_over(step, 0, [(p, g) for p, g in zip(params, grads) if g is not None])
            self.optimizer.zero_grad(self.plans[step].adam_step)
        return fn

    def measure(self, fn, spec, compile_first: bool) -> dict:
        """(compile +) warm-up, timed loop, profiled loop, memory, for one variant and key."""
        common.set_yarn(self.model, spec)
        common.reset_peak(self.device)
        unit_before, out = common.compile_counters(), {}
        if compile_first:
            start = time.perf_counter()
            fn(0)
            common.sync(self.device)
            out["compile_s"] = time.perf_counter() - start
        for i in range(WARM_STEPS):
            fn(i)
        before = common.compile_counters()
        out.update(common.time_steps(fn, self.args.steps, self.device))
        diff = common.counter_diff(before, common.compile_counters())
        out.update(recompiles_timed=common.recompiles(diff), counters_timed=diff)
        if self.device.type == "cuda" and not self.args.no_profile:
            dev = common.device_time_ms(fn, self.args.steps, self.device)
            out.update(dev)
            if dev["kernels_per_step"]:  # 0: CUPTI traced nothing (e.g. inside graphs): no ratio
                out.update(gpu_busy=dev["device_busy_ms"] / out["wall_ms"],
                           kernel_fraction=dev["kernel_ms"] / out["wall_ms"],
                           wall_over_kernel=out["wall_ms"] / dev["kernel_ms"])
        out.update(common.memory_gib(self.device))
        # whole unit, compile included: e.g. inductor.cudagraph_skips for reduce-overhead
        out["counters_unit"] = common.counter_diff(unit_before, common.compile_counters())
        return out


def run_variants(bench: StepBench, results: common.Results, started: float) -> None:
    args, data = bench.args, results.data
    errors = data["errors"]

    def unit(label: str, fn):
        if args.budget_s and time.perf_counter() - started > args.budget_s:
            errors[label] = {"error": f"skipped: --budget-s {args.budget_s} exhausted"}
            print(f"[{label}] skipped (budget)", flush=True)
            return None
        print(f"[{label}] ...", flush=True)
        out = common.run_guarded(label, fn, errors)
        results.save()
        return out

    def record(variant, spec, row):
        if row is not None:
            data["results"].setdefault(spec.name, {})[variant] = row
            print(f"[{variant} {spec.name}] wall {row['wall_ms']:.2f} ms/step, median "
                  f"{row['median_ms']:.2f}, busy {row.get('gpu_busy')}", flush=True)
        results.save()

    if "eager" in args.variants:
        eager = bench.runner("off")
        for spec in bench.specs:
            record("eager", spec, unit(f"eager {spec.name}", lambda: bench.measure(
                bench.runner_step(eager, spec), spec, compile_first=True)))
        del eager
    if "graphs" in args.variants:
        graphs = bench.runner("on")
        common.reset_peak(bench.device)
        for spec in bench.specs:  # visit 1 captures, visit 2 replays and self-checks
            def capture(spec=spec):
                common.set_yarn(bench.model, spec)
                fn = bench.runner_step(graphs, spec)
                fn(0)
                fn(1)
            unit(f"capture {spec.name}", capture)
        data["sealed"] = unit("seal", lambda: graphs.seal() or True) or False
        if bench.device.type == "cuda":
            torch.cuda.empty_cache()  # leaves the graph pool: what stays is what the graphs hold
        data["memory_all_captured"] = common.memory_gib(bench.device)
        for spec in bench.specs:
            if bench.step_keys[bench.first_step[spec.name]] in graphs.captured:
                record("graphs", spec, unit(f"graphs {spec.name}", lambda: bench.measure(
                    bench.runner_step(graphs, spec), spec, compile_first=False)))
        data["capture_report"] = graphs.capture_report()
        results.save()
    if "reduce-overhead" in args.variants:
        if bench.device.type != "cuda":
            errors["reduce-overhead"] = {"error": "skipped: CUDA only (--smoke)"}
            return
        # Drop dynamo's default-mode entries (eager and graphs are done) so the forward is
        # recompiled with the cudagraph backend, never served by a cached default-mode entry.
        torch._dynamo.reset()
        compiled = torch.compile(bench.model, mode="reduce-overhead", fullgraph=True, dynamic=False)
        handoff = GradHandoff(bench.optimizer.param_cfgs, bench.plans, 1)
        for spec in bench.specs:
            record("reduce-overhead", spec, unit(f"reduce-overhead {spec.name}", lambda: bench.measure(
                bench.reduce_overhead_step(compiled, handoff, spec), spec, compile_first=True)))


def summarize(bench: StepBench, data: dict) -> None:
    res = data["results"]
    ratio = lambda a, b: a / b if a is not None and b else None
    wall = lambda key, variant: res.get(key, {}).get(variant, {}).get("wall_ms")
    speedups = {}
    for key in res:
        speedups[key] = {"graphs_over_eager": ratio(wall(key, "graphs"), wall(key, "eager")),
                         "graphs_over_reduce_overhead": ratio(wall(key, "graphs"),
                                                              wall(key, "reduce-overhead")),
                         "reduce_overhead_over_eager": ratio(wall(key, "reduce-overhead"),
                                                             wall(key, "eager"))}
    data["speedups"] = speedups
    g = [r["graphs"] for r in res.values() if "graphs" in r]
    both = [k for k, r in res.items() if "graphs" in r and "eager" in r]
    check = lambda xs: all(xs) if xs else None  # None: nothing measured (e.g. CPU smoke)
    measured = lambda rows, name: [r[name] for r in rows if r.get(name) is not None]
    eager_peak = max((r["eager"]["max_reserved_gib"] or 0 for r in res.values() if "eager" in r),
                     default=None)
    captured = (data.get("memory_all_captured") or {}).get("reserved_gib")
    half = speedups.get("A_half", {}).get("graphs_over_eager")
    data["memory"] = {"static_reserved_gib": bench.static_gib, "eager_peak_reserved_gib": eager_peak,
                      "all_captured_reserved_gib": captured,
                      "all_captured_over_eager_peak": ratio(captured, eager_peak)}
    data["goals"] = {
        "graphs_never_slower_than_eager": check([wall(k, "graphs") <= wall(k, "eager") for k in both]),
        "graphs_gpu_busy_ge_99pct": check([x >= 0.99 for x in measured(g, "gpu_busy")]),
        "graphs_within_2pct_of_kernel_time": check([x <= 1.02 for x in measured(g, "wall_over_kernel")]),
        "half_key_graphs_le_0p7_eager": None if half is None else half <= 0.7,
        "all_captured_memory_le_1p3_eager_peak": (None if data["memory"]["all_captured_over_eager_peak"]
                                                  is None else
                                                  data["memory"]["all_captured_over_eager_peak"] <= 1.3),
        "no_recompiles_timed": check([v.get("recompiles_timed", 0) == 0
                                      for r in res.values() for v in r.values()]),
    }


def write_model_json(bench: StepBench, data: dict, path: Path) -> None:
    """bench/model.py's JSON from the eager variant (same compiled model, same process)."""
    out = common.Results(path, bench.device, bench="model",
                         source="bench/step_graphs.py --also-model-json: eager variant (EagerStep: "
                                "forward + backward + gradient handoff of the compiled model)",
                         settings={"steps": bench.args.steps, "smoke": bench.args.smoke,
                                   "attention_backend": bench.model.attention_backend,
                                   "fp8": bench.cfg.model.fp8.enabled},
                         flops_formula=model_bench.FLOPS_FORMULA, keys={},
                         errors={k: v for k, v in data["errors"].items() if k.startswith("eager")})
    for spec in bench.specs:
        row = data["results"].get(spec.name, {})
        if "eager" in row:
            e = row["eager"]
            timing = {k: e[k] for k in ("median_ms", "p10_ms", "p90_ms", "mean_ms", "min_ms",
                                        "max_ms", "n", "wall_ms")}
            out.data["keys"][spec.name] = model_bench.key_record(
                bench.model.config, spec, bench.inputs[spec.name][0][2], timing,
                compile_s=e.get("compile_s"), recompiles_timed=e.get("recompiles_timed"),
                max_allocated_gib=e.get("max_allocated_gib"),
                graphs_wall_ms=row.get("graphs", {}).get("wall_ms"))
    model_bench.finish(out)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--keys", default="A,B,C,D")
    p.add_argument("--half-key", action=argparse.BooleanOptionalAction, default=True,
                   help="also run A_half (8,192 tokens per rank)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--out", type=Path, default=Path("docs/results/step_graphs_h200.json"))
    p.add_argument("--also-model-json", type=Path, help="write bench/model.py's JSON here too")
    p.add_argument("--budget-s", type=float, default=0, help="skip units started after this (0: off)")
    p.add_argument("--no-profile", action="store_true", help="skip the profiled loops")
    p.add_argument("--fp8", action=argparse.BooleanOptionalAction, default=None,
                   help="fp8 lm head and MLP matmuls on/off (default: the preset's GPTConfig.fp8)")
    p.add_argument("--attention", choices=("auto", "flex", "varlen", "fa3", "reference"))
    p.add_argument("--smoke", action="store_true", help="CPU, tiny, stand-in graphs")
    args = p.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad:
        p.error(f"--variants: unknown {bad}; choose from {VARIANTS}")
    if args.smoke:
        args.steps = min(args.steps, 2)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    started = time.perf_counter()
    device = torch.device("cpu" if args.smoke else "cuda:0")
    settings = common.setup_torch(device)
    bench = StepBench(args, device)
    results = common.Results(
        args.out, device, bench="step_graphs",
        settings={**settings, "steps": args.steps, "variants": args.variants,
                  "keys": [s.name for s in bench.specs], "smoke": args.smoke,
                  "attention_backend": bench.model.attention_backend,
                  "fp8": bench.cfg.model.fp8.enabled, "warm_steps": WARM_STEPS},
        keys={s.name: StepGraphKey(*bench.step_keys[bench.first_step[s.name]])._asdict()
              for s in bench.specs},
        results={}, errors={})
    print(f"step-graph bench on {device}: keys {[s.name for s in bench.specs]}, variants "
          f"{args.variants}", flush=True)
    try:
        run_variants(bench, results, started)
    finally:
        summarize(bench, results.data)
        results.data["complete"] = True
        results.data["elapsed_s"] = time.perf_counter() - started
        results.save()
        rows = [dict(v, key=k, variant=name) for k, r in results.data["results"].items()
                for name, v in r.items()]
        common.print_table(rows, ["key", "variant", "wall_ms", "median_ms", "p10_ms", "p90_ms",
                                  "kernel_ms", "gpu_busy", "compile_s", "max_reserved_gib"])
        print(f"speedups: {results.data['speedups']}\ngoals: {results.data['goals']}\nerrors: "
              f"{list(results.data['errors'])}; wrote {args.out}", flush=True)
    if args.also_model_json:
        write_model_json(bench, results.data, args.also_model_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
