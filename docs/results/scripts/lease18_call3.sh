#!/usr/bin/env bash
# Eighteenth lease, call 3, right after call 2 on the same warm machine (carry [".carry/fa4b",
# ".carry/anchor_src", ".carry/anchor_modded", ".carry/tiktoken", "data/embedded"]): ours (fa4, quack
# MLP, fp8 lm head, recompute, and kernels/qk_norm_rope.py: call 1 measured it 0.969x at C) against
# the record at C. Stage A did not fit the session's device time left.
# Code at 06130b2 (calls 2-5 alike; the JSONs' git_revision says ec04d80-dirty, the device copy's
# older metadata). 299 s wall.
STAGES=C DATA=data/embedded OURS_SET="model.attention_backend=fa4 train.mlp_kernel=quack \
model.fp8.enabled=true model.fp8.sites=lm_head train.fused_loss_schedule=recompute \
train.qk_norm_rope=triton" bash scripts/gpu/vs_record.sh
