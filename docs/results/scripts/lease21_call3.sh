#!/usr/bin/env bash
# Twenty-first lease, call 3 (planned, not run yet: see call 1), right after call 2 (carry [".carry/fa4b"]; the machine holds
# .carry/fa4a, .carry/tiktoken, data/embedded and build/gemm_choice.txt from calls 1-2):
# scripts/gpu/host_bound.sh at A and C, one micro-step, graphs on and off, 8 profiled steps, with
# FlashAttention 4, the quack MLP, the fp8 lm head (recompute) and the q/k kernel: as it is
# ($OUT/base), then, where call 1 chose a cuBLAS setting, with it (--set train.blas=..., $OUT/gemm).
# Prediction: base busy at A ~96.5-97% (the window start weighs 4x less than with 2 steps); with
# the memsets gone ~98.5% and the graphs-on step ~0.5 ms shorter at A.
set -u
start=$(date +%s)
left() { echo $(( 585 - $(date +%s) + start )); }
export DATA=data/embedded PROFILE_STEPS=8 STAGES="A C"
export OURS_SET="model.attention_backend=fa4 train.mlp_kernel=quack model.fp8.enabled=true model.fp8.sites=lm_head train.fused_loss_schedule=recompute train.qk_norm_rope=triton"
root=$OUT
if [[ -s build/gemm_choice.txt ]]; then
  OUT=$root/base DEADLINE_S=$(( $(left) * 6 / 10 )) bash scripts/gpu/host_bound.sh
  OUT=$root/gemm DEADLINE_S=$(left) OURS_SET="$OURS_SET $(cat build/gemm_choice.txt)" bash scripts/gpu/host_bound.sh
else
  echo "no cuBLAS setting chosen in call 1: the base alone"
  OUT=$root/base DEADLINE_S=$(left) bash scripts/gpu/host_bound.sh
fi
