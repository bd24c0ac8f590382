#!/usr/bin/env bash
# Planned device call 1 of the next lease (nvidia-h200-x2, cold machine): `bash docs/results/scripts/s4_call1.sh`.
#   GPU 0 (first 5/8 of the CPU cores): small-gpu, graphs on, cold: the summary's phase_ms_by_stage
#          says where the ~85 ms per step outside the micro-steps goes (stage C: 840 vs 8 x 94.5 ms),
#          and --profile-steps 150:152 (two stage-C steps) gives their kernel table and trace
#   GPU 1 (the rest): the fp8 GPU tests (quantisation as traced code, not yet GPU-run), then fp8
#          vs bf16 forward + backward at keys A and C with the top kernels profiled
# Within the warm window after it, s4_call2.sh reuses this call's inductor cache.
source scripts/gpu/common.sh  # run from the repo root
n=$(nproc); split=$(( n * 5 / 8 ))
( CUDA_VISIBLE_DEVICES=0 TORCHINDUCTOR_COMPILE_THREADS=$split T1S_SYSTEM_PYTHON=1 timeout 585 \
    taskset -c "0-$((split - 1))" ./run.sh --preset small-gpu --graphs on --run-id small-gpu-on-phases \
    --profile-steps 150:152 --runs-dir "$OUT/runs" --no-save-final > "$L/small_gpu_on_phases.log" 2>&1
  echo "exit $? after $(elapsed) s" >> "$L/small_gpu_on_phases.log" ) &
A=$!
export TORCHINDUCTOR_COMPILE_THREADS=$(( n - split ))
side1=(taskset -c "$split-$((n - 1))")
CUDA_VISIBLE_DEVICES=1 timeout 120 "${side1[@]}" python3 -m pytest -m gpu -q -p no:cacheprovider -rA \
    tests/test_fp8_gpu.py > "$L/gpu_tests_fp8.log" 2>&1; echo "exit $? after $(elapsed) s" >> "$L/gpu_tests_fp8.log"
for fp8 in fp8 no-fp8; do
  CUDA_VISIBLE_DEVICES=1 timeout $(( 580 - $(elapsed) )) "${side1[@]}" python3 bench/model.py --keys A,C --$fp8 \
      --profile-top 20 --out "$L/model_${fp8}_profiled.json" > "$L/model_${fp8}.log" 2>&1
  echo "exit $? after $(elapsed) s" >> "$L/model_${fp8}.log"
done
wait $A
cp "$L"/*.json "$OUT/" 2>/dev/null
pack_outputs
