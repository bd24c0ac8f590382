#!/usr/bin/env bash
# Nineteenth lease, call 4, right after call 3 on the same warm machine (carry []: the machine held
# .carry/fa4a, .carry/fa4b, .carry/tiktoken and data/embedded from calls 1-3): the small-gpu preset's
# warmup (every key: compile, capture, self-check) with the fast set, every cache in a fresh folder:
# inductor's, fa4's, quack's and Triton's own (~/.triton, our kernels outside inductor), unlike
# lease17_call4.sh, which left Triton's warm.
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
