#!/usr/bin/env bash
# Thirty-fourth session, call 3 (a fresh machine; carry [".carry/tiktoken", "data/embedded"]): on
# an H200, line 6 of issue 17 in one call (too little device time was left for the warmup + run
# pair): scripts/gpu/micro1_compare.sh run on a cold machine (on: compile + capture, then 188
# steps; off on the warm caches with what on leaves; report compare). On any other card nothing
# runs.
nvidia-smi -L
if ! nvidia-smi -L | grep -q H200; then echo "not an H200: nothing run"; exit 0; fi
exec bash scripts/gpu/micro1_compare.sh run
