#!/usr/bin/env bash
# Thirty-second session, call 3, a fresh machine; carry ["data/embedded", ".carry/baseline"]:
# call 2's s32_ngram_event.sh again after the bench's fix (every variant now gets the first
# store's summed accumulator: call 2's separately held stores drifted apart by whole Adam steps,
# max |diff| 0.24-4.0, from index_add_'s unordered float32 sums). Same prediction
# (docs/results/ngram_event_tied_2026-12-07/README.md): kernel vs baseline max |diff| 0.0, vs the
# reference float32 rounding.
bash docs/results/scripts/s32_ngram_event.sh
source scripts/gpu/common.sh
pack_outputs
