#!/usr/bin/env bash
# Planned device call 2 of the next lease (nvidia-h200-x2, within the warm window after s4_call1.sh).
#   GPU 0 (first half of the cores): the step-graph bench at key B, eager vs graphs vs reduce-overhead
#          (the one key not yet measured with reduce-overhead)
#   GPU 1 (second half): the trainer GPU tests (graphs on/off, resume, deterministic resume; -v so
#          that tests finished before a timeout still show)
source scripts/gpu/common.sh  # run from the repo root
n=$(nproc); h=$(( n / 2 ))
export TORCHINDUCTOR_COMPILE_THREADS=$h
( CUDA_VISIBLE_DEVICES=0 timeout 560 taskset -c "0-$((h - 1))" python3 bench/step_graphs.py --keys B --no-half-key \
    --budget-s 450 --out "$L/step_graphs_ro_h200_B.json" > "$L/bench_B.log" 2>&1
  echo "exit $? after $(elapsed) s" >> "$L/bench_B.log" ) &
A=$!
CUDA_VISIBLE_DEVICES=1 timeout 570 taskset -c "$h-$((n - 1))" python3 -m pytest -m gpu -v -p no:cacheprovider -rA \
    tests/test_train_gpu.py > "$L/gpu_tests_train.log" 2>&1
echo "exit $? after $(elapsed) s" >> "$L/gpu_tests_train.log"
wait $A
cp "$L"/*.json "$OUT/" 2>/dev/null
pack_outputs
