#!/usr/bin/env bash
# Device call 2 (nvidia-h200-x2, 2026-11-30): the small-gpu preset with graphs on (GPU 0) and graphs
# off (GPU 1), side by side in one call from a cold compile cache (each process compiles its own
# graphs; they share inductor's on-disk cache dir). GPU 0's run writes the portable compile cache.
# Run from the repo root with $OUT set; results land in $OUT.
source scripts/gpu/common.sh  # run from the repo root
run() {  # gpu graphs run_id [extra flags]
  local gpu=$1 graphs=$2 id=$3; shift 3
  CUDA_VISIBLE_DEVICES=$gpu timeout 575 python3 -m track_1_short.train --preset small-gpu \
      --graphs "$graphs" --run-id "$id" --runs-dir "$OUT/runs" --no-save-final "$@" > "$L/$id.log" 2>&1
  echo "exit $? after $(elapsed) s" >> "$L/$id.log"
}
run 0 on small-gpu-graphs-on --compile-cache "$OUT/compile_cache.bin" &
run 1 off small-gpu-graphs-off &
wait
pack_outputs
