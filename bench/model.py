"""Model benchmark: forward + backward ms and MFU of the compiled GPT at each speedrun key, as JSON.

What it measures, per key (DESIGN section 3, per-rank shapes of 8 ranks; --keys A,B,C,D):
- forward + backward of the trainer's model (trainer/build.py: bf16 banks, embeddings and head on
  CUDA; torch.compile(fullgraph=True, dynamic=False)): step_graphs.training_loss (loss.sum()) and
  capture_support.loss_grads w.r.t. every parameter plus the n-gram sink, exactly the eager step
  (EagerStep) minus the gradient handoff, on a synthetic packed batch (bench/common.py) with
  n-gram slots from NgramStore.slots_for (computed once, outside the timed loop);
- median / p10 / p90 over --iters steps from CUDA events at step boundaries (no sync inside the
  loop), and host wall ms per step; compile seconds (first call, forward and backward);
- recompiles during the timed loop (new dynamo graphs + AOTAutograd compiles; must be 0);
- peak memory (reset before each key), attention backend, versions, GPU;
- MFU = model FLOPs / time / 790 TFLOP/s (H200 dense bf16). Model FLOPs (formula in the JSON):
  6 x matmul parameters x T (real bank entries of qk/vo/mlp + lm head; gathers, gates and
  norms not counted) + attention: per attention layer 4 x T x min(window, mean document length)
  x D forward, x3 for forward + backward (the issue's approximation; paired-head layers counted
  like the others). `attention_exact_causal` counts keys actually attended (sum over documents of
  min(t + 1, window)); neither counts FlexAttention's work on partially masked 128-blocks.

Reference (issue): modded-nanogpt HEAD with FA2, same H200 and shapes: 27.97 / 53.43 / 80.12 ms
per micro-step at A / B / C, ~56% MFU at C. Goals: MFU >= 35% and <= 100 ms at key C.

Run (H200, ~5-6 min for 4 keys, mostly compile):
    PYTHONPATH=. python bench/model.py --out docs/results/model_h200.json
Smoke (CPU, tiny config, no compile): PYTHONPATH=. python bench/model.py --smoke --out /tmp/m.json
bench/step_graphs.py --also-model-json PATH writes this file's format from its eager variant, so
one process (one compile) serves both benches.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from bench import common
from track_1_short.constants import H200_DENSE_BF16_TFLOPS
from track_1_short.model.gpt_config import BACKENDS
from track_1_short.perf.cuda_graphs.capture_support import loss_grads
from track_1_short.perf.ngram_store import NgramStore
from track_1_short.perf.cuda_graphs.step_graphs import training_loss

REFERENCE_MS = {"A": 27.97, "B": 53.43, "C": 80.12}  # modded-nanogpt HEAD, FA2, one H200
GOAL_MFU_C, GOAL_MS_C = 0.35, 100.0
FLOPS_FORMULA = (
    "model_flops = 6 * matmul_params * T + sum over attention layers of 3 * 4 * T * "
    "min(window, mean_doc_len) * D; matmul_params = qk_bank[:n_attn*H] + vo_bank[:2*n_attn] + "
    "mlp_bank[:L] + lm_head (real entries, padding excluded); window = ws_long on long_window_layers "
    "else ws_short; paired-head layers counted like the others; mfu = model_flops / seconds / "
    f"{H200_DENSE_BF16_TFLOPS:g}e12")


def matmul_params(c) -> dict[str, int]:
    n_attn = len(c.attention_layers)
    return {"qk_bank": n_attn * c.num_heads * 2 * c.head_dim * c.model_dim,
            "vo_bank": 2 * n_attn * c.model_dim * c.model_dim,
            "mlp_bank": c.num_layers * 2 * c.mlp_hidden * c.model_dim,
            "lm_head": c.model_dim * c.vocab_size}


def _keys_attended(pieces: list[int], window: int) -> int:
    """Sum over documents and positions t of min(t + 1, window): causal sliding-window keys."""
    total = 0
    for n in pieces:
        full = min(n, window)
        total += full * (full + 1) // 2 + (n - full) * window
    return total


def flops(c, spec: common.KeySpec, pieces: list[int]) -> dict:
    """Model FLOPs of one forward + backward at `spec` (see FLOPS_FORMULA)."""
    params = matmul_params(c)
    t, d = spec.tokens, c.model_dim
    mean_doc = sum(pieces) / len(pieces)
    attn, exact = 0.0, 0.0
    for layer in c.attention_layers:
        window = spec.ws_long if layer in c.long_window_layers else spec.ws_short
        attn += 3 * 4 * t * min(window, mean_doc) * d
        if layer in c.paired_head_layers:  # 2T positions of H/2 heads; the window is in positions
            exact += 3 * 4 * (d // 2) * _keys_attended([2 * n for n in pieces], window)
        else:
            exact += 3 * 4 * d * _keys_attended(pieces, window)
    dense = 6 * sum(params.values()) * t
    return {"matmul_params": params, "matmul_params_total": sum(params.values()),
            "mean_doc_len": mean_doc, "num_docs": len(pieces), "dense_flops": dense,
            "attention_flops": attn, "attention_exact_causal_flops": exact,
            "model_flops": dense + attn}


def key_record(c, spec: common.KeySpec, pieces: list[int], timing: dict, **extra) -> dict:
    """One key's JSON row: timing + FLOPs + MFU (from the median) + reference comparison."""
    f = flops(c, spec, pieces)
    seconds = timing["median_ms"] / 1e3
    peak = H200_DENSE_BF16_TFLOPS * 1e12
    row = {"key": spec.name, "tokens": spec.tokens, "cu_seqlens_rows": spec.cu_seqlens_rows,
           "ws_short": spec.ws_short, "ws_long": spec.ws_long, "max_seq_len": spec.max_seq_len,
           "mtp_targets": len(spec.mtp_weights), **timing, **f,
           "tflops_per_s": f["model_flops"] / seconds / 1e12,
           "mfu": f["model_flops"] / seconds / peak,
           "mfu_exact_causal": (f["dense_flops"] + f["attention_exact_causal_flops"]) / seconds / peak,
           "reference_ms": REFERENCE_MS.get(spec.name),
           "ms_vs_reference": (timing["median_ms"] / REFERENCE_MS[spec.name]
                               if spec.name in REFERENCE_MS else None)}
    row.update(extra)
    return row


def goals(keys: dict) -> dict:
    c = keys.get("C")
    if not c or "median_ms" not in c:
        return {"mfu_C_ge_35pct": None, "ms_C_le_100": None, "no_recompiles": None}
    return {"mfu_C_ge_35pct": c["mfu"] >= GOAL_MFU_C, "ms_C_le_100": c["median_ms"] <= GOAL_MS_C,
            "no_recompiles": all(k.get("recompiles_timed", 0) == 0 for k in keys.values())}


def finish(results: common.Results) -> None:
    results.data["goals"] = goals(results.data["keys"])
    results.data["complete"] = True
    results.save()
    rows = [dict(r, key=name) for name, r in results.data["keys"].items()]
    common.print_table(rows, ["key", "tokens", "median_ms", "p10_ms", "p90_ms", "mfu",
                              "reference_ms", "compile_s", "recompiles_timed", "max_allocated_gib"])
    print(f"goals: {results.data['goals']}; errors: {list(results.data['errors'])}; "
          f"wrote {results.path}", flush=True)


def bench_key(spec, model, fn, device, iters: int, warmup: int, profile_top: int = 0) -> dict:
    common.set_yarn(model, spec)
    batch, pieces = common.model_batch(spec, model, device, seed=1000 + spec.tokens)
    # rows of a zero table (the store holds no gradient here: cycle and micro-steps of 1)
    slots = NgramStore(model.ngram_table, cycle=1, micro_steps=1).slots_for(batch.inputs)
    cfg = common.forward_config(spec, device)
    sink = model.ngram_table.grad_sink(spec.tokens)
    leaves = [p for _, p in model.named_parameters()] + [sink]

    def step(_):
        loss = training_loss(fn, batch.inputs, batch.targets, batch.cum_seqlens, slots, cfg, sink,
                             model.value_embeds.grad_accum)
        loss_grads(loss, leaves)

    common.reset_peak(device)
    start = time.perf_counter()
    step(0)  # compiles forward and backward for this key
    common.sync(device)
    compile_s = time.perf_counter() - start
    for i in range(warmup):
        step(i)
    before = common.compile_counters()
    timing = common.time_steps(step, iters, device)
    diff = common.counter_diff(before, common.compile_counters())
    if profile_top > 0 and device.type == "cuda":  # after the timed loop: timing stays unprofiled
        timing["profile"] = common.device_time_ms(step, iters, device, top=profile_top)
    return key_record(model.config, spec, pieces, timing, compile_s=compile_s,
                      recompiles_timed=common.recompiles(diff), counters_timed=diff,
                      **common.memory_gib(device))


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--keys", default="A,B,C,D")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after the compiling one")
    p.add_argument("--out", type=Path, default=Path("docs/results/model_h200.json"))
    p.add_argument("--fp8", action=argparse.BooleanOptionalAction, default=None,
                   help="fp8 lm head and MLP matmuls on/off (default: the preset's GPTConfig.fp8)")
    p.add_argument("--attention", choices=BACKENDS)
    p.add_argument("--no-compile", action="store_true", help="time the uncompiled model")
    p.add_argument("--profile-top", type=int, default=0, metavar="N",
                   help="also profile --iters steps (torch.profiler, CUDA): kernel and busy ms per "
                        "step and the N kernels with the most time")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny config and shapes, no compile")
    args = p.parse_args(argv)
    if args.smoke:
        args.iters, args.warmup, args.no_compile = min(args.iters, 2), 0, True
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    device = torch.device("cpu" if args.smoke else "cuda:0")
    settings = common.setup_torch(device)
    specs = common.select_specs(args.keys, args.smoke, half_key=False)
    cfg, model = common.build_bench_model(args.smoke, device, args.attention,
                                          args.fp8)
    fn = model if args.no_compile else torch.compile(model, fullgraph=True, dynamic=False)
    results = common.Results(args.out, device, bench="model", source="bench/model.py",
                             settings={**settings, "iters": args.iters, "warmup": args.warmup,
                                       "compile": not args.no_compile, "smoke": args.smoke,
                                       "attention_backend": model.attention_backend,
                                       "fp8": cfg.model.fp8.enabled},
                             flops_formula=FLOPS_FORMULA, keys={}, errors={})
    print(f"model bench on {device}: keys {[s.name for s in specs]}, attention "
          f"{model.attention_backend}, compile {not args.no_compile}", flush=True)
    for spec in specs:
        row = common.run_guarded(f"key {spec.name}", lambda: bench_key(
            spec, model, fn, device, args.iters, args.warmup, args.profile_top),
            results.data["errors"])
        if row is not None:
            results.data["keys"][spec.name] = row
            print(f"key {spec.name}: {row['median_ms']:.2f} ms, MFU {row['mfu']:.3f}, compile "
                  f"{row['compile_s']:.1f} s, recompiles {row['recompiles_timed']}", flush=True)
        results.save()
    finish(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
