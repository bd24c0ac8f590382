#!/usr/bin/env bash
# Seventeenth lease, call 3, right after call 2 on the same warm machine (carry [".carry/fa4b",
# ".carry/tiktoken", "data/embedded"]): one micro-step per step, graphs on / off, at A and C with
# the fast set. 146 s wall.
OURS_SET="$(cat build/choose/fast_set.txt)" STAGES="A C" DATA=data/embedded bash scripts/gpu/host_bound.sh
cd "$OUT" && tar czf hb_logs.tgz logs && rm -rf logs
