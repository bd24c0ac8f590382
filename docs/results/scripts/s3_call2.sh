#!/usr/bin/env bash
# Device call 2 of session 3 (nvidia-h200-x2, issued within the warm window after call 1, so
# build/inductor_cache from call 1 is on disk): the small-gpu preset back to back on GPU 0,
# `--graphs off`, then `--graphs on` if at least 300 s of the 10-minute command are left.
# Nothing else runs on the machine meanwhile. `bash docs/results/scripts/s3_call2.sh`, $OUT set.
source scripts/gpu/common.sh  # run from the repo root
export CUDA_VISIBLE_DEVICES=0 TORCHINDUCTOR_COMPILE_THREADS=$(nproc) T1S_SYSTEM_PYTHON=1
for mode in off on; do
  left=$(( 588 - $(elapsed) ))
  if [[ $mode == on && $left -lt 300 ]]; then
    echo "graphs on skipped: $left s left" >> "$L/skipped.txt"; break
  fi
  timeout "$left" ./run.sh --preset small-gpu --graphs "$mode" --run-id "small-gpu-$mode-warm" \
      --runs-dir "$OUT/runs" --no-save-final > "$L/small_gpu_${mode}_warm.log" 2>&1
  echo "exit $? after $(elapsed) s" >> "$L/small_gpu_${mode}_warm.log"
done
pack_outputs
