#!/usr/bin/env bash
# Thirty-second session, call 2, right after call 1 (.carry/fa4a on the warm machine); carry
# [".carry/fa4b", "data/embedded", ".carry/baseline"].
# 1. s32_ngram_event.sh: the event alone, current kernels vs the one-kernel baseline vs the
#    reference (as run in this call, the loop was inline here; same commands);
# 2. s27_call3.sh: host_bound at A and C, one micro-step, graphs on and off, the "cand" set.
# Prediction (docs/results/ngram_event_tied_2026-12-07/README.md).
start_call=$(date +%s)
bash docs/results/scripts/s32_ngram_event.sh
DEADLINE_S=$(( 585 - ($(date +%s) - start_call) )) bash docs/results/scripts/s27_call3.sh
