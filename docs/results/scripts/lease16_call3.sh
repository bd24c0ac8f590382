#!/usr/bin/env bash
# Sixteenth lease, call 3 (one H200, right after call 2 on the same warm machine; carry
# [".carry/fa4b", ".carry/tiktoken", "data/embedded"]), from the repo root with $OUT set:
#   bash docs/results/scripts/lease16_call3.sh
# 1. scripts/gpu/host_bound.sh at A and C (one micro-step per step, graphs on and off) with the
#    fast set call 2 ran (build/choose/fast_set.txt: fa4, quack, the fp8 head, recompute and what
#    call 1 chose), until DEADLINE_S=470;
# 2. the recompute forward's launch sweep: bench/loss_kernel.py --sweep-only --sweep-tanh-only.
source scripts/gpu/common.sh
set_items=$(cat build/choose/fast_set.txt 2>/dev/null || echo "model.attention_backend=fa4 \
train.mlp_kernel=quack model.fp8.enabled=true model.fp8.sites=lm_head train.fused_loss_schedule=recompute")
echo "fast set: $set_items" | tee "$OUT/fast_set.txt"
mkdir -p "$OUT/host_bound"
OUT="$OUT/host_bound" DEADLINE_S=470 STAGES="A C" DATA=data/embedded OURS_SET="$set_items" \
    bash scripts/gpu/host_bound.sh
timeout -k 5 $(( $(left) - 5 )) python3 bench/loss_kernel.py --sweep-only --sweep-tanh-only \
    --out "$OUT/loss_kernel_sweep.json" > "$OUT/loss_kernel_sweep.log" 2>&1
echo "exit $? after $(elapsed) s" >> "$OUT/loss_kernel_sweep.log"
tail -n 30 "$OUT/loss_kernel_sweep.log"
rm -rf "$L" "$OUT/runs"
ls -la "$OUT" "$OUT/host_bound"
