#!/usr/bin/env bash
# Nineteenth lease, call 3, right after call 2 on the same warm machine (carry [".carry/fa4b"]; the
# machine held .carry/fa4a, the record's harness, .carry/tiktoken and data/embedded from calls 1-2):
# ours (fa4, quack MLP, fp8 lm head, recompute, and the q/k kernel, chosen by call 1 at 0.975x)
# against the record at A and C in one command. Code at 531e416. 401 s wall.
bash scripts/gpu/choose_then_vs_record.sh compare
