#!/usr/bin/env bash
# One small-gpu run on GPU 0: `bash scripts/gpu/small_gpu.sh on|off`. For the graphs-on vs off
# comparison on one machine, run `on` and then, within the device tool's 30 s warm window, `off`:
# build/inductor_cache stays on the warm machine's disk (ignored paths are kept between calls), so
# the second run mostly hits the compile cache. Needs $OUT; results land in $OUT.
source "$(dirname "$0")/common.sh"
graphs=${1:?usage: small_gpu.sh on|off}
CUDA_VISIBLE_DEVICES=0 timeout 580 python3 -m track_1_short.train --preset small-gpu \
    --graphs "$graphs" --run-id "small-gpu-graphs-$graphs" --runs-dir "$OUT/runs" --no-save-final \
    > "$L/small_gpu_graphs_$graphs.log" 2>&1
echo "exit $? after $(elapsed) s" >> "$L/small_gpu_graphs_$graphs.log"
pack_outputs
