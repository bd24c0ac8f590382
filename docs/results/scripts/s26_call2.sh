#!/usr/bin/env bash
# Twenty-sixth session, call 2, right after call 1 on the same warm machine (carry [".carry/fa4b",
# ".carry/tiktoken", "data/embedded"]; the machine holds .carry/fa4a and build/gemm_choice.txt):
# one rank's step of the 8-GPU run at STAGE (default A), one micro-step, graphs on and off, 8
# profiled steps (scripts/gpu/host_bound.sh), the fast set (FlashAttention 4, the quack MLP, the
# fp8 lm head with recompute, the q/k kernel):
#   $OUT/base  as it is;
#   $OUT/cand  plus call 1's cuBLAS choice (if any) and Polar Express on quack's GEMMs
#              (optim.polar_gemms=quack).
# Prediction (A): base ~97% busy with graphs (the memset-adjacent gaps are ~1.0 of ~1.6 ms idle
# per two steps in lease 18's trace); cand >= 98.5% busy, the graphs-on step ~1.5 ms shorter
# (~0.5 ms of memsets and their gaps, ~1.1 ms of Polar Express device time on even steps, ~0.8 on
# odd), and graphs off no faster there (quack's host launch cost per GEMM, eager).
set -u
start=$(date +%s)
left() { echo $(( 585 - $(date +%s) + start )); }
export DATA=data/embedded PROFILE_STEPS=8 STAGES=${STAGE:-A}
nvidia-smi -L | grep -q H100 && export MACHINE=h100 || export MACHINE=h200  # names the JSON
export OURS_SET="model.attention_backend=fa4 train.mlp_kernel=quack model.fp8.enabled=true model.fp8.sites=lm_head train.fused_loss_schedule=recompute train.qk_norm_rope=triton"
root=$OUT
cand="$OURS_SET $(cat build/gemm_choice.txt 2>/dev/null) optim.polar_gemms=quack"
echo "cand: $cand"
OUT=$root/base DEADLINE_S=$(( $(left) * 55 / 100 )) bash scripts/gpu/host_bound.sh
OUT=$root/cand DEADLINE_S=$(left) OURS_SET="$cand" bash scripts/gpu/host_bound.sh
