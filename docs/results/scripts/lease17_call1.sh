#!/usr/bin/env bash
# Seventeenth lease, call 1 (one H200, cold; carry [".carry/fa4a", ".carry/anchor_src",
# ".carry/anchor_modded", ".carry/tiktoken", "data/embedded"]; code at fa65962): the record's warm-up
# at its stages 0 and 2, ours at C (fp8 lm head, recompute; default attention and MLP) as it is
# (the paired layers' attention output read in place) and with the reference's copy back
# (GPTConfig.paired_head_copies, then named unpair_attention_out). 471 s wall.
# Run from the repo root with $OUT set:
CANDIDATE="model.unpair_attention_out=true" bash scripts/gpu/choose_then_vs_record.sh choose
