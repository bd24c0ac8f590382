# Sourced by the device-call scripts in this folder: environment, log folder, machine facts,
# `run_trainer`, `run_anchor` (the record's harness), `run_gpu_tests`, `use_fa4_packages`, `left`
# (seconds to the call's deadline) and `pack_outputs` (the device tool returns at most 8 files of
# <= 16 MiB: logs and runs go in one tarball, a larger compile cache is split). Needs $OUT (the
# device tool's output folder).
set -u
export TIKTOKEN_CACHE_DIR=$PWD/.carry/tiktoken PYTHONPATH=. PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=$PWD/build/inductor_cache
# flash-attn-4's CuTe DSL kernels and quack's GEMM autotuning, cached on disk beside inductor's
# (build/ is git-ignored and kept by a warm machine between calls): only the fa4 backend and the
# quack MLP read them
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=$PWD/build/fa4_cache
export QUACK_CACHE_DIR=$PWD/build/quack_cache QUACK_CACHE_AUTOTUNING=1
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

# The record's harness (shared/anchor_modded, copied by scripts/gpu/prepare_carry.sh into
# .carry/anchor_src, its tokenizer in .carry/anchor_modded): `run_anchor MODE LIMIT_S [KEY=VALUE ...]`
# runs `run.sh MODE` with its output in $OUT/anchor (timing.json or loss.jsonl + loss.json, MODE.log)
# and its console in $L/anchor_MODE.log. TIMEOUT_S=LIMIT_S (SIGINT: the harness still writes its
# JSON; allow ~10-30 s more for the exit). Its compile caches go to .carry/anchor_work, apart from
# ours; a warm machine keeps them between calls as long as the carry names .carry's subfolders,
# never .carry itself (a carried path replaces its folder on the device machine).
run_anchor() {
  local mode=${1:?usage: run_anchor MODE LIMIT_S [KEY=VALUE ...]} limit=${2:?}
  shift 2
  local log="$L/anchor_${mode/+/_}.log"
  if [[ ! -f .carry/anchor_src/run.sh || ! -d .carry/anchor_modded/tiktoken_cache ]]; then
    echo "run_anchor: .carry/anchor_src or .carry/anchor_modded missing: run scripts/gpu/prepare_carry.sh" \
         "on the CPU machine and carry both" | tee -a "$log" >&2
    return 2
  fi
  env -u TORCHINDUCTOR_CACHE_DIR bash .carry/anchor_src/run.sh "$mode" WORK=.carry/anchor_work \
      OUT_DIR="$OUT/anchor" TIMEOUT_S="$limit" "$@" > "$log" 2>&1
  echo "exit $? after $(elapsed) s" >> "$log"
}

# `use_fa4_packages`: flash-attn-4 and quack-kernels from the two-call carry of
# scripts/gpu/fa4_wheels.sh (fa4_install.sh, log in $L), then on PYTHONPATH (.fa4_site/ENV);
# a failed install prints its log, packs the outputs and exits 2.
use_fa4_packages() {
  bash scripts/gpu/fa4_install.sh > "$L/fa4_install.log" 2>&1 || { cat "$L/fa4_install.log"; pack_outputs; exit 2; }
  source .fa4_site/ENV
}

# `use_fa4_packages_for ITEMS`: use_fa4_packages where the --set items ITEMS name the fa4
# attention backend, the quack MLP or quack's Polar Express GEMMs (optim.polar_gemms=quack): the
# only settings that import them.
use_fa4_packages_for() {
  if [[ "${1:-}" =~ (fa4|quack) ]]; then use_fa4_packages; fi
}

# `run_gpu_tests LOG LIMIT_S [pytest args: files, -k ..., -s]`: the GPU tests (-m gpu -v -rA)
# into LOG, then "exit CODE after N s"; its last lines on the console.
run_gpu_tests() {
  local log=${1:?usage: run_gpu_tests LOG LIMIT_S [pytest args]} limit=${2:?}
  shift 2
  timeout -k 15 "$limit" python3 -m pytest -m gpu -v -p no:cacheprovider -rA "$@" > "$log" 2>&1
  echo "exit $? after $(elapsed) s" >> "$log"
  tail -n 25 "$log"
}

# Seconds left before DEADLINE_S (default 585: the device tool's 600 s call limit, less packing).
left() { echo $(( ${DEADLINE_S:-585} - $(elapsed) )); }

# `pack_outputs [DIR ...]`: logs, runs and the named folders of $OUT into results.tgz. The device
# tool returns at most RETURN_FILES (8) files: where more are left under $OUT, every one but
# results.tgz and the compile cache's parts goes into outputs.tgz as well (a call that wrote more
# lost its test log on 2026-12-03).
RETURN_FILES=8
pack_outputs() {
  local dirs=(logs runs) d
  for d in "$@"; do [[ -e "$OUT/$d" ]] && dirs+=("$d"); done
  (
    cd "$OUT" && tar czf results.tgz "${dirs[@]}" && rm -rf "${dirs[@]}"
    if [[ -f compile_cache.bin && $(stat -c %s compile_cache.bin) -gt 16000000 ]]; then
      split -b 15M -d compile_cache.bin compile_cache.bin.part && rm compile_cache.bin
    fi
    if (( $(find . -type f | wc -l) > RETURN_FILES )); then
      local list
      list=$(mktemp)
      find . -type f ! -name results.tgz ! -name 'compile_cache.bin*' -printf '%P\n' | sort > "$list"
      tar czf outputs.tgz -T "$list" && xargs -d '\n' rm -f < "$list"
      rm -f "$list"
      find . -mindepth 1 -type d -empty -delete
    fi
    ls -laR .
  )
}

# `run_variants TAG MARGIN_S MIN_S RUNNER FLAGS_FN`: every name in $VARIANTS is first checked with
# the caller's `FLAGS_FN NAME` (prints the name's flags; nonzero for an unknown name: return 2),
# then, one after the other, `RUNNER NAME LIMIT_S FLAGS...` with LIMIT_S the seconds left to the
# deadline less MARGIN_S (a variant with MIN_S or less left is skipped); a line per variant with
# RUNNER's exit status in $L/TAG.log.
run_variants() {
  local tag=${1:?usage: run_variants TAG MARGIN_S MIN_S RUNNER FLAGS_FN} margin=${2:?} min=${3:?}
  local runner=${4:?} flags_fn=${5:?} v limit rc extra
  for v in $VARIANTS; do "$flags_fn" "$v" > /dev/null || return 2; done
  for v in $VARIANTS; do
    limit=$(( $(left) - margin ))
    (( limit > min )) || { echo "skipped $v: $limit s left" | tee -a "$L/$tag.log"; continue; }
    read -r -a extra <<< "$("$flags_fn" "$v")"
    "$runner" "$v" "$limit" "${extra[@]}"
    rc=$?
    echo "$v: exit $rc after $(elapsed) s (limit $limit s; flags: ${extra[*]:-none})" | tee -a "$L/$tag.log"
  done
}
