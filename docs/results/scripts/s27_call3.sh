#!/usr/bin/env bash
# Twenty-seventh session, call 3, right after call 2; carry ["data/embedded"] (.carry/fa4a and
# fa4b stay on the warm machine from calls 1-2). At the code with narrow_linear's weight gradient
# as a chunked float32 bmm (e3035b9): scripts/gpu/host_bound.sh at A and C, one micro-step, graphs
# on and off, 8 profiled steps, fast set + train.blas=no_workspace + optim.polar_gemms=quack
# ("cand").
# Prediction, from call 1's gates timing: the one-block gate weight-gradient GEMMs of session 26's
# traces (0.98 ms per step at A, 2.16 ms at C) become a few bmm kernels under 0.15 ms, so on-time
# ~1 ms below session 26's cand at A and ~2 ms at C on a like host; busy >= 98.8% at A; 0 syncs.
set -u
nvidia-smi -L | grep -q H100 && export MACHINE=h100 || export MACHINE=h200  # names the JSON
export DATA=data/embedded PROFILE_STEPS=8 STAGES="A C"
export OURS_SET="model.attention_backend=fa4 train.mlp_kernel=quack model.fp8.enabled=true model.fp8.sites=lm_head train.fused_loss_schedule=recompute train.qk_norm_rope=triton train.blas=no_workspace optim.polar_gemms=quack"
bash scripts/gpu/host_bound.sh
