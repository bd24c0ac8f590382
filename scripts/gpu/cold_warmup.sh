#!/usr/bin/env bash
# The small-gpu preset's warmup (every key: compile, capture, self-check; --warmup-only) with the
# fast set of build/choose/fast_set.txt (written by choose_then_vs_record.sh compare), every cache
# in a fresh folder: inductor's, FlashAttention 4's, quack's and Triton's own (our kernels outside
# inductor). From the repo root, on a warm machine after the compare call (it needs fa4 installed
# from .carry/fa4a + .carry/fa4b and data/embedded there; carry []). Log and run dir packed in
# $OUT/cold_logs.tgz.
source scripts/gpu/common.sh; use_fa4_packages
export TORCHINDUCTOR_CACHE_DIR=$PWD/build/cold_ind FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=$PWD/build/cold_fa4 \
    QUACK_CACHE_DIR=$PWD/build/cold_quack TRITON_CACHE_DIR=$PWD/build/cold_triton
rm -rf build/cold_ind build/cold_fa4 build/cold_quack build/cold_triton
s=(); for i in $(cat build/choose/fast_set.txt); do s+=(--set "$i"); done
/usr/bin/time -v timeout -k 10 540 python3 -m track_1_short.train --preset small-gpu --graphs on --warmup-only \
    --run-id cold --runs-dir "$OUT/runs" --no-save-final --data-dir data/embedded "${s[@]}" \
    > "$L/small_gpu_cold_warmup.log" 2>&1
echo "exit $? after $(elapsed) s" >> "$L/small_gpu_cold_warmup.log"
tail -25 "$L/small_gpu_cold_warmup.log"
cd "$OUT" && tar czf cold_logs.tgz logs runs && rm -rf logs runs
