#!/usr/bin/env bash
# Fourteenth lease, call 3 (one H200, warm from call 2: the record's compile caches in
# .carry/anchor_work, the fa4 tarball's first half; carry [".carry/fa4b", ".carry/anchor_src",
# ".carry/anchor_modded", ".carry/tiktoken", "data/embedded"]): our fast kernels (FA4, the quack
# MLP, the fp8 lm head) with the fused loss in the schedule SCHEDULE against the record at A and C
# in one command (scripts/gpu/vs_record.sh).
# Run from the repo root with $OUT set: SCHEDULE=recompute bash docs/results/scripts/lease14_call3.sh
SCHEDULE=${SCHEDULE:-recompute}
STAGES="A C" DATA=data/embedded OURS_SET="model.attention_backend=fa4 train.mlp_kernel=quack \
model.fp8.enabled=true model.fp8.sites=lm_head train.fused_loss_schedule=$SCHEDULE" \
    bash scripts/gpu/vs_record.sh
