#!/usr/bin/env bash
# Twenty-second lease (2026-12-05), call 3, right after lease21_call2.sh on the same warm machine
# (carry [".carry/fa4b"]; the machine holds .carry/fa4a, .carry/tiktoken, data/embedded and
# build/gemm_choice.txt from calls 1-2). lease21_call3.sh ran the base and the cuBLAS setting one
# after the other; this session's device time (1,529 s left after two refused starts) leaves one
# short call, so only the setting call 1 chose runs (the base's numbers: lease 18,
# docs/results/vs_record_h200_2026-12-03_lease18): scripts/gpu/host_bound.sh at A and C, one
# micro-step, graphs on and off, 8 profiled steps, with FlashAttention 4, the quack MLP, the fp8 lm
# head (recompute) and the q/k kernel. DEADLINE_S: the seconds this call may take.
# Prediction: with the memsets gone, busy with graphs at A ~98.5% (lease 18: 95.9% with 2 profiled
# steps), the graphs-on step ~0.5 ms shorter than lease 18's; on/off at A still ~0.9x.
set -u
export DATA=data/embedded PROFILE_STEPS=8 STAGES="A C"
export OURS_SET="model.attention_backend=fa4 train.mlp_kernel=quack model.fp8.enabled=true model.fp8.sites=lm_head train.fused_loss_schedule=recompute train.qk_norm_rope=triton"
if [[ -s build/gemm_choice.txt ]]; then
  OURS_SET="$OURS_SET $(cat build/gemm_choice.txt)"
else
  echo "no cuBLAS setting chosen in call 1: the base"
fi
bash scripts/gpu/host_bound.sh
