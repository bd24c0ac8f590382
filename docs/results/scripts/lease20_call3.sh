#!/usr/bin/env bash
# Twentieth lease, call 3, right after call 2 on the same warm machine (carry [".carry/fa4b"]; the
# machine holds .carry/fa4a, the record's harness, .carry/tiktoken and data/embedded from calls
# 1-2): ours (fa4, quack MLP, fp8 lm head, recompute, the q/k kernel from call 1's BASE_EXTRA, and
# the pulled embedding gradient, the default, unless call 1 found dense faster) against the record
# at A and C in one command. Code at 93cd7f5 (git_revision in the JSONs: 9874465-dirty, as call 1
# says). 427.5 s wall.
bash scripts/gpu/choose_then_vs_record.sh compare
