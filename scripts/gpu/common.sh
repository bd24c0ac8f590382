# Sourced by the device-call scripts in this folder: environment, log folder, machine facts, and
# `pack_outputs` (the device tool returns at most 8 files of <= 16 MiB: logs and runs go in one
# tarball, a larger compile cache is split). Needs $OUT (the device tool's output folder).
set -u
export TIKTOKEN_CACHE_DIR=$PWD/.carry/tiktoken PYTHONPATH=. PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=$PWD/build/inductor_cache
# NVLink multicast stays off on this workplace's multi-GPU machines (see the device tool's KINDS.md)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
L=$OUT/logs
mkdir -p "$L" "$OUT/runs"
nvidia-smi -L > "$L/gpus.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$L/gpus.txt"
start=$(date +%s)

elapsed() { echo $(( $(date +%s) - start )); }

pack_outputs() {
  cd "$OUT" && tar czf results.tgz logs runs && rm -rf logs runs
  if [[ -f compile_cache.bin && $(stat -c %s compile_cache.bin) -gt 16000000 ]]; then
    split -b 15M -d compile_cache.bin compile_cache.bin.part && rm compile_cache.bin
  fi
  ls -la "$OUT"
}
