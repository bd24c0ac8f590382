#!/usr/bin/env bash
# Fifteenth lease, call 3 (one H200, cold; carry [".carry/tiktoken", "data/embedded"]), the
# session's last ~400 device-s: the hold's atomic-free row accumulation (kernels/row_accumulate.py)
# 1. its GPU tests (against index_add_ at A and C shapes, captured, no host sync; times printed);
# 2. bench/ngram_hold.py at A and C (index_add_, index_put_, the kernel, the hold both ways);
# 3. our stage-C step (default attention and MLP, the fp8 lm head in the recompute schedule, 8
#    micro-steps, graphs on) with train.ngram_accumulate=sorted, its trace kept, against the same
#    step without it in call 1 (another machine: the hold's kernels compare, the step does not).
# Run from the repo root with $OUT set: DEADLINE_S=290 bash docs/results/scripts/lease15_call3.sh
export DEADLINE_S=${DEADLINE_S:-290}
source scripts/gpu/common.sh
run_gpu_tests "$L/row_accumulate_gpu_tests.log" 90 -s tests/test_row_accumulate_gpu.py
for stage in C A; do
  timeout -k 5 60 python3 bench/ngram_hold.py --stage $stage --data-dir data/embedded \
      --out "$OUT/ngram_hold_$stage.json" > "$L/ngram_hold_$stage.log" 2>&1
  echo "exit $? after $(elapsed) s" >> "$L/ngram_hold_$stage.log"
  cat "$L/ngram_hold_$stage.log"
done
mkdir -p "$OUT/traces"
timeout -k 10 $(( $(left) - 10 )) python3 bench/step.py --stage C --steps 20 --graphs on --micro-steps 8 \
    --data-dir data/embedded --set model.fp8.enabled=true --set model.fp8.sites=lm_head \
    --set train.fused_loss_schedule=recompute --set train.ngram_accumulate=sorted \
    --trace-dir "$OUT/traces" --out "$OUT/c_sorted.json" > "$L/c_sorted.log" 2>&1
echo "exit $? after $(elapsed) s" >> "$L/c_sorted.log"
tail -n 3 "$L/c_sorted.log"
cd "$OUT" && tar czf call3_logs.tgz logs && rm -rf logs runs
ls -la "$OUT"
