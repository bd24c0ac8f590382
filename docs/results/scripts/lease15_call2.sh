#!/usr/bin/env bash
# Fifteenth lease, call 2 (one H200, warm from call 1: the record's compile caches in
# .carry/anchor_work, the fa4 tarball's first half, build/lease15/; carry [".carry/fa4b",
# ".carry/anchor_src", ".carry/anchor_modded", ".carry/tiktoken", "data/embedded"]): our fast
# kernels (FA4, the quack MLP, the fp8 lm head in the recompute schedule) against the record at A
# and C in one command (scripts/gpu/vs_record.sh). Inductor's coordinate_descent_tuning is added
# when call 1 measured it at least 0.5% faster at C with at most 60 s more warmup.
# Run from the repo root with $OUT set: bash docs/results/scripts/lease15_call2.sh
set_items="model.attention_backend=fa4 train.mlp_kernel=quack model.fp8.enabled=true \
model.fp8.sites=lm_head train.fused_loss_schedule=recompute"
cdt=$(python3 - <<'PY'
import json
try:
    b, c = (json.load(open(f"build/lease15/c_{n}.json"))["variants"]["on"] for n in ("base", "cdt"))
    faster = c["step_ms"]["median_ms"] < 0.995 * b["step_ms"]["median_ms"]
    print("yes" if faster and c["warmup_s"] - b["warmup_s"] <= 60 else "no")
except (OSError, KeyError, ValueError):
    print("no")
PY
)
echo "coordinate_descent_tuning: $cdt" | tee "$OUT/cdt_choice.txt"
[[ "$cdt" == yes ]] && set_items="$set_items train.coordinate_descent_tuning=true"
STAGES="A C" DATA=data/embedded OURS_SET="$set_items" bash scripts/gpu/vs_record.sh
