#!/usr/bin/env bash
# Eighteenth lease, call 1 (one H200, cold; 500 s wall; carry [".carry/fa4a", ".carry/anchor_src",
# ".carry/anchor_modded", ".carry/tiktoken", "data/embedded"]; code at ec04d80): the record's warm-up
# at its stages 0 and 2, ours at C (fp8 lm head, recompute; default attention and MLP) with the
# torch q/k norm + RoPE path, then with kernels/qk_norm_rope.py.
# Run from the repo root with $OUT set:
CANDIDATE="train.qk_norm_rope=triton" bash scripts/gpu/choose_then_vs_record.sh choose
