#!/usr/bin/env bash
# Twenty-sixth session, call 5, right after call 4 (which carried [".carry/fa4a"] to a machine new
# to the session); carry [".carry/fa4b", ".carry/tiktoken", "data/embedded"]. At the code with
# model/gpt.narrow_linear (the smear and value-embedding gates as a product and a sum, no cuBLAS
# GEMM): scripts/gpu/host_bound.sh at A and C, one micro-step, graphs on and off, 8 profiled
# steps, with the fast set plus train.blas=no_workspace and optim.polar_gemms=quack (calls 2-3's
# "cand").
# Prediction, against calls 2-3's cand on the first machine (another H100: compare with care):
# the one-block gate weight-gradient GEMMs gone (0.97 ms per step at A, 2.16 at C in those
# traces), so the graphs-on step ~1 ms shorter at A and ~2 ms at C; busy >= 98.8% at A, ~99.4% at
# C; on / off at A below 0.8x where this host issues eager steps as slowly as the first (45 ms).
set -u
nvidia-smi -L | grep -q H100 && export MACHINE=h100 || export MACHINE=h200  # names the JSON
export DATA=data/embedded PROFILE_STEPS=8 STAGES="A C"
export OURS_SET="model.attention_backend=fa4 train.mlp_kernel=quack model.fp8.enabled=true model.fp8.sites=lm_head train.fused_loss_schedule=recompute train.qk_norm_rope=triton train.blas=no_workspace optim.polar_gemms=quack"
bash scripts/gpu/host_bound.sh
