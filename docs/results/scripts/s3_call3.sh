#!/usr/bin/env bash
# Device call 3 of session 3 (nvidia-h200-x2, within the warm window after call 2): the step-graph
# bench with all three variants (eager, graphs, reduce-overhead) in one process per GPU, each
# process on its own half of the CPU cores. (Run at the time as the same commands inline.)
#   GPU 0: keys A_half and A        GPU 1: keys C and D
source scripts/gpu/common.sh  # run from the repo root
export TORCHINDUCTOR_COMPILE_THREADS=16
( CUDA_VISIBLE_DEVICES=0 timeout 540 taskset -c 0-15 python3 bench/step_graphs.py --keys A --budget-s 420 \
    --out "$OUT/step_graphs_h200_ro_A.json" > "$L/bench_A.log" 2>&1; echo "exit $? after $(elapsed) s" >> "$L/bench_A.log" ) &
CUDA_VISIBLE_DEVICES=1 timeout 540 taskset -c 16-31 python3 bench/step_graphs.py --keys C,D --no-half-key --budget-s 420 \
    --out "$OUT/step_graphs_h200_ro_CD.json" > "$L/bench_CD.log" 2>&1; echo "exit $? after $(elapsed) s" >> "$L/bench_CD.log"
wait
cp "$OUT"/*.json "$L/"
pack_outputs
