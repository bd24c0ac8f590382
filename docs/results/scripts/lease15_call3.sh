#!/usr/bin/env bash
# Fifteenth lease, call 3 (one H200, cold; carry [".carry/tiktoken", "data/embedded"]), the
# session's last ~480 device-s: one rank's step of the 8-GPU run (--micro-steps 1) at A and C,
# graphs on vs off, default kernels, the n-gram rows inside the step and the banks read through
# one unbind each (scripts/gpu/host_bound.sh, ending by DEADLINE_S).
# Run from the repo root with $OUT set: bash docs/results/scripts/lease15_call3.sh
DEADLINE_S=${DEADLINE_S:-360} STAGES="A C" DATA=data/embedded bash scripts/gpu/host_bound.sh
