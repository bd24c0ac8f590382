#!/usr/bin/env bash
# fp8 (every GEMM operand layout made in traced code) against bf16 at key A, side by side:
# `bash docs/results/scripts/s5_fp8_bench.sh LIMIT_S` on nvidia-h200-x2: GPU 0 runs bench/model.py --fp8,
# GPU 1 --no-fp8, each on half the cores, each with --profile-top 20 (is aten's strided fp8 copy
# gone, and is fp8 now faster than bf16?). LIMIT_S: the device seconds left for the call.
source scripts/gpu/common.sh  # run from the repo root
limit=${1:?usage: s5_fp8_bench.sh LIMIT_S}
(( limit > 0 )) || { echo "s5_fp8_bench.sh: LIMIT_S must be > 0 (timeout 0 means no limit), got '$limit'" >&2; exit 2; }
n=$(nproc); h=$(( n / 2 ))
export TORCHINDUCTOR_COMPILE_THREADS=$h
bench() {  # bench GPU CORES MODE
  CUDA_VISIBLE_DEVICES=$1 timeout "$limit" taskset -c "$2" python3 bench/model.py --keys A --"$3" \
      --profile-top 20 --out "$OUT/model_$3_layouts_A.json" > "$L/model_$3.log" 2>&1
  echo "exit $? after $(elapsed) s" >> "$L/model_$3.log"
}
bench 0 "0-$((h - 1))" fp8 &
bench 1 "$h-$((n - 1))" no-fp8
wait
pack_outputs
