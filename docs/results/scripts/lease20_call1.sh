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
# First attempt at d79a3f4 (docs/results/vs_record_h200_2026-12-04_lease20/call1a/): the baseline
# ran (634.3 ms); the dense candidate failed the step graphs' self-check (embed.weight's gradient
# 1.4% off eager): the dense path then gathered with weight[ids], whose backward adds in bf16 with
# atomics; pull_rows' dense path is F.embedding since (float32 sums, as before this change). The
# machine went back while that was fixed: this script ran again on a new one (call1/), code at
# 93cd7f5 (the JSONs' git_revision reads 9874465-dirty: the device copy is the working tree over
# the session's first commit), 467 s wall; the first attempt 463 s.
BASE_EXTRA="train.qk_norm_rope=triton" CANDIDATE="train.embed_grad=dense" bash scripts/gpu/choose_then_vs_record.sh choose
