#!/usr/bin/env bash
# Twentieth lease, call 1, machine new to this session (carry [".carry/anchor_src",
# ".carry/anchor_modded", ".carry/tiktoken", "data/embedded"]; the fa4 parts go in calls 2 and 3
# alone, as scripts/gpu/choose_then_vs_record.sh says). The record's warm-up at its stages 0 and 2,
# then ours at C (default attention and MLP, fp8 lm head, recompute, the q/k kernel: BASE_EXTRA, as
# lease 19 chose it) with the token embedding's
# gradient pulled into its float32 buffer (train.embed_grad=pull, the new default), then with
# autograd's dense embedding gradient (train.embed_grad=dense, the code before): the change side by
# side at C. Prediction: dense slower by ~2 ms per step (the [V, D] embedding backward, ~0.2 ms per
# micro-step at C in the lease-19 trace, and its accumulator add, ~0.06 ms, gone).
BASE_EXTRA="train.qk_norm_rope=triton" CANDIDATE="train.embed_grad=dense" bash scripts/gpu/choose_then_vs_record.sh choose
