#!/usr/bin/env bash
# Fifteenth lease, call 1 (one H200, cold; carry [".carry/fa4a", ".carry/anchor_src",
# ".carry/anchor_modded", ".carry/tiktoken", "data/embedded"]): the fa4 tarball's first half rides
# along for call 2. 1. the record's timing at its stages 0 and 2 (fills its compile caches in
# .carry/anchor_work for call 2's vs_record.sh); 2. ours at stage C, 8 micro-steps, graphs on, the
# fp8 lm head in the recompute schedule with the default attention and MLP (no fa4 yet), with the
# banks read through one unbind each (model/gpt.BankViews), its profiler trace kept; 3. the same
# with inductor's coordinate_descent_tuning. Both JSONs also go to build/lease15/ (kept by the warm
# machine) for call 2's choice.
# Run from the repo root with $OUT set: bash docs/results/scripts/lease15_call1.sh
source scripts/gpu/common.sh
run_anchor timing 250 TIMING_STAGES=0,2
cp "$OUT/anchor/timing.json" "$OUT/record_warm_timing.json" 2>/dev/null
mkdir -p build/lease15 "$OUT/traces"
base=(--stage C --steps 20 --graphs on --micro-steps 8 --data-dir data/embedded
      --set model.fp8.enabled=true --set model.fp8.sites=lm_head --set train.fused_loss_schedule=recompute)
timeout -k 10 170 python3 bench/step.py "${base[@]}" --trace-dir "$OUT/traces" --out "$OUT/c_base.json" \
    > "$L/c_base.log" 2>&1
echo "exit $? after $(elapsed) s" >> "$L/c_base.log"
timeout -k 10 $(( $(left) - 10 )) python3 bench/step.py "${base[@]}" --set train.coordinate_descent_tuning=true \
    --out "$OUT/c_cdt.json" > "$L/c_cdt.log" 2>&1
echo "exit $? after $(elapsed) s" >> "$L/c_cdt.log"
cp "$OUT"/c_*.json build/lease15/ 2>/dev/null
tail -n 3 "$L"/c_*.log
cd "$OUT" && tar czf call1_logs.tgz anchor logs && rm -rf anchor logs
ls -la "$OUT" "$OUT/traces"
