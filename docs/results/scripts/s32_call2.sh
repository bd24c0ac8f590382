#!/usr/bin/env bash
# Thirty-second session, call 2, right after call 1 (.carry/fa4a on the warm machine); carry
# [".carry/fa4b", "data/embedded", ".carry/baseline"] (.carry/baseline/ngram_adam_f8a25d6.py:
# `git show f8a25d6:track_1_short/kernels/ngram_adam.py`, the one-kernel event before this change).
# 1. bench/ngram_event.py, the event alone, current kernels vs that baseline vs the reference, on
#    real tokens: stage A with 2 held micro-steps (one micro-step per step, the 8-GPU run's
#    per-rank regime), stage C with 2 and with 16 (one GPU, 8 micro-steps);
# 2. s27_call3.sh: host_bound at A and C, one micro-step, graphs on and off, the "cand" set.
# Prediction (docs/results/ngram_event_tied_2026-12-07/README.md).
source scripts/gpu/common.sh
for spec in "A 2" "C 2" "C 16"; do
  read -r stage held <<< "$spec"
  log="$L/ngram_event_${stage}_held$held.log"
  timeout -k 10 150 python3 bench/ngram_event.py --stage "$stage" --held "$held" --events 20 \
      --baseline-kernel .carry/baseline/ngram_adam_f8a25d6.py --data-dir data/embedded \
      --out "$OUT/ngram_event_${stage}_held$held.json" > "$log" 2>&1
  echo "exit $? after $(elapsed) s" >> "$log"
  tail -n 5 "$log"
done
DEADLINE_S=$(( 585 - $(elapsed) )) bash docs/results/scripts/s27_call3.sh
