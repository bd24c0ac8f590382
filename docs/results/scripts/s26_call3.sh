#!/usr/bin/env bash
# Twenty-sixth session, call 3, right after call 2 on the same warm machine (carry []): call 2's
# script at stage C (STAGE=C: base and cand, one micro-step, graphs on and off).
# Prediction (C): base ~98.6% busy, on / off ~1.0x (GPU-bound); cand ~99% busy and ~1.5 ms shorter
# per step with graphs; graphs never slower than off.
STAGE=C bash docs/results/scripts/s26_call2.sh
