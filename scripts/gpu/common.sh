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

# One trainer run: `run_trainer PRESET NGPUS MODE [LIMIT_S]`, MODE one of warmup (compile + capture
# every key, then exit: --warmup-only), on, off (--graphs on|off); log in $L/PRESET-NGPUSgpu-MODE.log,
# run dir under $OUT/runs. LIMIT_S (default 580; a run ignoring SIGTERM is killed 15 s later) keeps the device tool's
# 600 s call limit.
run_trainer() {
  local preset=${1:?usage: run_trainer PRESET NGPUS warmup|on|off [LIMIT_S]} ngpus=${2:?} mode=${3:?}
  local limit=${4:-580} flags
  case "$mode" in
    warmup) flags=(--graphs on --warmup-only) ;;
    on|off) flags=(--graphs "$mode") ;;
    *) echo "run_trainer: MODE must be warmup, on or off, got '$mode'" >&2; return 2 ;;
  esac
  local id="$preset-${ngpus}gpu-$mode"
  timeout -k 15 "$limit" python3 -m torch.distributed.run --standalone --nproc_per_node "$ngpus" \
      -m track_1_short.train --preset "$preset" "${flags[@]}" --run-id "$id" --runs-dir "$OUT/runs" \
      --no-save-final > "$L/$id.log" 2>&1
  echo "exit $? after $(elapsed) s" >> "$L/$id.log"
}

pack_outputs() {
  cd "$OUT" && tar czf results.tgz logs runs && rm -rf logs runs
  if [[ -f compile_cache.bin && $(stat -c %s compile_cache.bin) -gt 16000000 ]]; then
    split -b 15M -d compile_cache.bin compile_cache.bin.part && rm compile_cache.bin
  fi
  ls -la "$OUT"
}
