#!/usr/bin/env bash
# Sixteenth lease, call 4 (one H200, cold: calls 1 and 2 were not back to back, so the record's
# caches and the fa4 half were gone; carry [".carry/tiktoken", "data/embedded"]), from the repo
# root with $OUT set: bash docs/results/scripts/lease16_call4.sh
# 1. our stage-C step (8 micro-steps, graphs on; default attention and MLP, the fp8 lm head in the
#    recompute schedule) with the hold's index_add_, then with train.ngram_accumulate=vector_atomic
#    (one process each, one after the other; the second's inductor cache is warm);
# 2. scripts/gpu/host_bound.sh at A and C with vector_atomic (one micro-step, graphs on and off);
# 3. the recompute forward's launch sweep (bench/loss_kernel.py --sweep-only --sweep-tanh-only).
source scripts/gpu/common.sh
base=(--stage C --steps 20 --graphs on --micro-steps 8 --data-dir data/embedded
      --set model.fp8.enabled=true --set model.fp8.sites=lm_head --set train.fused_loss_schedule=recompute)
for v in index_add vector_atomic; do
  timeout -k 10 170 python3 bench/step.py "${base[@]}" --set train.ngram_accumulate=$v \
      --out "$OUT/c_$v.json" > "$L/c_$v.log" 2>&1
  echo "exit $? after $(elapsed) s" | tee -a "$L/c_$v.log"
done
mkdir -p "$OUT/host_bound"
OUT="$OUT/host_bound" DEADLINE_S=$(( 585 - $(elapsed) - 80 )) STAGES="A C" DATA=data/embedded \
    OURS_SET="train.ngram_accumulate=vector_atomic" bash scripts/gpu/host_bound.sh | tail -n 20
timeout -k 5 $(( $(left) - 5 )) python3 bench/loss_kernel.py --sweep-only --sweep-tanh-only \
    --out "$OUT/loss_kernel_sweep.json" > "$L/loss_kernel_sweep.log" 2>&1
echo "exit $? after $(elapsed) s" >> "$L/loss_kernel_sweep.log"
tail -n 25 "$L/loss_kernel_sweep.log"
cd "$OUT" && tar czf call4_logs.tgz logs && rm -rf logs runs
ls -la "$OUT" "$OUT/host_bound"
