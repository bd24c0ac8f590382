#!/usr/bin/env bash
# Twenty-sixth session, call 6, right after call 5 on the same warm machine (carry []): the same
# fast set and narrow gates with cuBLAS's own setting (train.blas=default) and Polar Express on
# quack's GEMMs, graphs on only, at A then C (bench/step.py, 20 timed + 8 profiled steps, traces
# kept): what no_workspace buys once the gates no longer need split-K.
# Prediction: A ~0.5 ms per step slower than call 5's graphs-on step and ~97.3% busy (the 120
# memsets per step and the gaps around them back); C within ~0.5 ms of call 5 (its ssched kernels
# ~0.3 ms faster than the memset ones in calls 2-3, the no-workspace non-split-K dW ones about even).
source scripts/gpu/common.sh
use_fa4_packages
set_items=()
for item in model.attention_backend=fa4 train.mlp_kernel=quack model.fp8.enabled=true model.fp8.sites=lm_head \
    train.fused_loss_schedule=recompute train.qk_norm_rope=triton optim.polar_gemms=quack; do
  set_items+=(--set "$item")
done
for stage in A C; do
  limit=$(( $(left) - 15 )); [[ $stage == A ]] && limit=$(( limit / 2 ))
  timeout -k 10 "$limit" python3 bench/step.py --stage $stage --steps 20 --graphs on --micro-steps 1 \
      --profile-steps 8 --data-dir data/embedded --trace-dir "$L" --out "$OUT/step_default_blas_$stage.json" \
      "${set_items[@]}" > "$L/step_default_blas_$stage.log" 2>&1
  echo "exit $? after $(elapsed) s (limit $limit s)" >> "$L/step_default_blas_$stage.log"
  tail -n 3 "$L/step_default_blas_$stage.log"
done
pack_outputs
