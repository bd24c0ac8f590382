#!/usr/bin/env bash
# Thirty-fourth session, call 3 (a fresh machine; carry [".carry/tiktoken", "data/embedded"]): on
# an H200, line 6 of issue 17 in one call (too little device time was left for the warmup + run
# pair): scripts/gpu/micro1_compare.sh on (cold: compile + capture, then 188 steps; its tarball
# kept as results_on.tgz), then micro1_compare.sh off on the warm caches with what is left of the
# 585 s; `report compare` runs here on the two run dirs. On any other card nothing runs.
nvidia-smi -L
if ! nvidia-smi -L | grep -q H200; then echo "not an H200: nothing run"; exit 0; fi
t0=$(date +%s)
DEADLINE_S=440 bash scripts/gpu/micro1_compare.sh on
mv "$OUT/results.tgz" "$OUT/results_on.tgz"
DEADLINE_S=$(( 585 - ($(date +%s) - t0) )) bash scripts/gpu/micro1_compare.sh off
