#!/usr/bin/env bash
# Seventeenth lease, call 2, right after call 1 on the same warm machine (carry [".carry/fa4b",
# ".carry/anchor_src", ".carry/anchor_modded", ".carry/tiktoken", "data/embedded"]): ours (fa4, quack
# MLP, fp8 lm head, recompute) against the record at A and C. 415 s wall.
bash scripts/gpu/choose_then_vs_record.sh compare
