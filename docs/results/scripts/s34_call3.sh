#!/usr/bin/env bash
# Thirty-fourth session, call 3 (a fresh machine; carry [".carry/tiktoken", "data/embedded"]): on
# an H200, scripts/gpu/micro1_compare.sh warmup (its call 4, `bash scripts/gpu/micro1_compare.sh
# run`, follows within the warm window); on any other card nothing runs.
nvidia-smi -L
if ! nvidia-smi -L | grep -q H200; then echo "not an H200: nothing run"; exit 0; fi
exec bash scripts/gpu/micro1_compare.sh warmup
