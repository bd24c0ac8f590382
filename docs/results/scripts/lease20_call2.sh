#!/usr/bin/env bash
# Twentieth lease, call 2, right after call 1 on the same warm machine (carry [".carry/fa4a"] alone:
# the 64 MiB limit, scripts/gpu/choose_then_vs_record.sh): only brings the first half of the fa4
# wheels; the call-1 attempt that failed (see call 1) and the warm window of ~30 s left no budget
# for the stage-A side by side planned here.
# 0.3 s wall.
ls -la .carry/fa4a build/choose; nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
