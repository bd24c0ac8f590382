#!/usr/bin/env bash
# Twenty-seventh session, call 4, right after call 3 on the same warm machine; carry [] (fa4
# carries and data/embedded stay there). The same as call 3 with the default cuBLAS setting
# (train.blas=default, polar quack kept): the same-machine baseline for what no_workspace buys now
# that the gate weight gradients no longer need cuBLAS.
# Prediction: graphs-on step within 0.5 ms of call 3 at A and C (no_workspace drops ~120 memsets
# of ~2 us each at A); busy ~97.5-98% at A (memsets and split-K reductions between GEMMs).
set -u
nvidia-smi -L | grep -q H100 && export MACHINE=h100 || export MACHINE=h200  # names the JSON
export DATA=data/embedded PROFILE_STEPS=8 STAGES="A C"
export OURS_SET="model.attention_backend=fa4 train.mlp_kernel=quack model.fp8.enabled=true model.fp8.sites=lm_head train.fused_loss_schedule=recompute train.qk_norm_rope=triton optim.polar_gemms=quack"
bash scripts/gpu/host_bound.sh
