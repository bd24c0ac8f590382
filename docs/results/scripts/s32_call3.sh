#!/usr/bin/env bash
# Thirty-second session, call 3, a fresh machine; carry ["data/embedded", ".carry/baseline"]:
# call 2's bench/ngram_event.py runs again after the bench's fix (every variant now gets the first
# store's summed accumulator: call 2's separately held stores drifted apart by whole Adam steps,
# max |diff| 0.24-4.0, from index_add_'s unordered float32 sums). Same three shapes, same
# prediction (docs/results/ngram_event_tied_2026-12-07/README.md): kernel vs baseline max |diff|
# 0.0, vs the reference float32 rounding.
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
pack_outputs
