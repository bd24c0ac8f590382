#!/usr/bin/env bash
# Nineteenth lease, call 1, machine new to this session (carry [".carry/anchor_src",
# ".carry/anchor_modded", ".carry/tiktoken", "data/embedded"]: with .carry/fa4a too the call was
# over the device tool's 64 MiB, the tracked files now being ~15 MiB on disk; the fa4 parts went in
# calls 2 and 3 alone, the machine keeping the ignored paths of call 1). The record's warm-up at its
# stages 0 and 2, then ours at C (default attention and MLP, fp8 lm head, recompute) with the torch
# q/k path, then with kernels/qk_norm_rope.py. Code at 531e416. 455 s wall.
CANDIDATE="train.qk_norm_rope=triton" bash scripts/gpu/choose_then_vs_record.sh choose
