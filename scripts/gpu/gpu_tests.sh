#!/usr/bin/env bash
# The GPU test suite (or some of its files) on a device machine, logged for docs/results/.
#   bash scripts/gpu/gpu_tests.sh LOG_NAME LIMIT_S [pytest args: test files, -k ...]
# Writes $OUT/LOG_NAME (pytest -v -rA output, then "exit CODE after N s"). Needs the carried
# .carry/tiktoken (GPT-2 BPE, see common.sh) and data/embedded (the trainer tests).
source scripts/gpu/common.sh  # run from the repo root
name=${1:?usage: gpu_tests.sh LOG_NAME LIMIT_S [pytest args]} limit=${2:?}
shift 2
run_gpu_tests "$OUT/$name" "$limit" "$@"
