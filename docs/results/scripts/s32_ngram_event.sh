#!/usr/bin/env bash
# Thirty-second session: bench/ngram_event.py at three held-row shapes, the current event kernels
# vs .carry/baseline/ngram_adam_f8a25d6.py (`git show f8a25d6:track_1_short/kernels/ngram_adam.py`,
# the one-kernel event) vs the reference, on real tokens (data/embedded): stage A with 2 held
# micro-steps (one micro-step per step, the 8-GPU run's per-rank regime), stage C with 2 and with
# 16 (one GPU, 8 micro-steps). Run by s32_call2.sh and s32_call3.sh; leaves its JSON in $OUT and
# its logs in $OUT/logs (the caller packs them).
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
