#!/usr/bin/env bash
# Device call 2 (nvidia-h200-x2, 2026-11-30): the small-gpu preset with graphs on (GPU 0) and graphs
# off (GPU 1), side by side in one call from a cold compile cache (each process compiles its own
# graphs; they share inductor's on-disk cache dir). GPU 0's run writes the portable compile cache.
# Run from the repo root with $OUT set; results land in $OUT.
set -u
export TIKTOKEN_CACHE_DIR=$PWD/.carry/tiktoken PYTHONPATH=. PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=$PWD/build/inductor_cache TORCHINDUCTOR_COMPILE_THREADS=8
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
L=$OUT/logs; mkdir -p "$L" "$OUT/runs"
nvidia-smi -L > "$L/gpus.txt"; python3 -c "import torch,triton;print(torch.__version__,triton.__version__)" >> "$L/gpus.txt"
start=$(date +%s)
run() {  # gpu graphs run_id [extra flags]
  local gpu=$1 graphs=$2 id=$3; shift 3
  CUDA_VISIBLE_DEVICES=$gpu timeout 575 python3 -m track_1_short.train --preset small-gpu \
      --graphs "$graphs" --run-id "$id" --runs-dir "$OUT/runs" --no-save-final "$@" > "$L/$id.log" 2>&1
  echo "exit $? after $(( $(date +%s) - start )) s" >> "$L/$id.log"
}
run 0 on small-gpu-graphs-on --compile-cache "$OUT/compile_cache.bin" &
run 1 off small-gpu-graphs-off &
wait
cd "$OUT" && tar czf results.tgz logs runs && rm -rf logs runs
if [[ -f compile_cache.bin && $(stat -c %s compile_cache.bin) -gt 16000000 ]]; then
  split -b 15M -d compile_cache.bin compile_cache.bin.part && rm compile_cache.bin
fi
ls -la "$OUT"
