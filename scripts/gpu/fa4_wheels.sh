#!/usr/bin/env bash
# Here, on the CPU machine with PyPI: FlashAttention 4 (the "fa4" attention backend,
# model/attention_fa4.py) and its dependencies installed for the H200 hosts (Python 3.12, x86_64,
# CUDA 13) into a site folder, packed as one xz tarball (~79 MiB; the wheels are ~109 MiB) and cut
# into two git-ignored carry folders, each small enough for one device call beside the tracked
# files and a small data carry (the device tool moves 64 MiB per call):
#   .carry/fa4a  the tarball's first 40 MiB and SHA256SUMS
#   .carry/fa4b  the rest
#   bash scripts/gpu/fa4_wheels.sh        (from the repo root; ~3 min, mostly xz)
# Two device calls back to back (a warm machine keeps the first call's ignored paths; the second
# must start within its idle window, ~30 s): the first carries [".carry/fa4a"] (it may run
# anything that needs no other carry), the second [".carry/fa4b", ...] and runs
# `bash scripts/gpu/fa4_install.sh` first (joins, checks, unpacks into .fa4_site); then
# `source .fa4_site/ENV` and python3 imports flash_attn.cute.
# einops, cuda-bindings (with cuda-pathfinder) and protobuf are in the hosts' image (KINDS.md's
# package list; every install so far logged "fallbacks added: none"), so they stay out of the
# tarball (cuda-bindings alone is ~25 MiB packed) unless FA4_FALLBACK=1: then they go into its
# fallback/ folder, and fa4_install.sh adds each only where the host's Python lacks it.
set -euo pipefail
cd "$(dirname "$0")/../.."
git check-ignore -q .carry/fa4a || { echo "fa4_wheels: .carry/ is not git-ignored here" >&2; exit 2; }
MAIN=(flash-attn-4==4.0.0b36 quack-kernels==0.6.5 nvidia-cutlass-dsl==4.8.1
      nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1
      nvidia-cutlass-dsl-libs-cu13==4.8.1 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5)
FALLBACK=(einops==0.8.2 cuda-bindings==13.0.3 cuda-pathfinder==1.9.1 protobuf==6.33.6)
PY=${PYTHON:-.venv/bin/python}
[[ -x "$PY" ]] || PY=python3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
target() {  # DIR PACKAGES...: install for the hosts' platform, no dependency resolution
  local dir=$1; shift
  "$PY" -m pip install -q --no-deps --pre --only-binary=:all: --python-version 3.12 \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
      --target "$dir" "$@" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
}
target "$tmp/fa4/site" "${MAIN[@]}"
[[ "${FA4_FALLBACK:-0}" == 1 ]] && target "$tmp/fa4/fallback" "${FALLBACK[@]}"
[[ -f $tmp/fa4/site/flash_attn/cute/interface.py ]] || { echo "fa4_wheels: the install failed" >&2; exit 1; }
(cd "$tmp" && tar cf - fa4 | xz -T0 -6 > fa4.tar.xz)
tracked=$(git ls-files -z | xargs -0 -r du -cb | tail -1 | cut -f1)
part0=$(( 58 * 1048576 - tracked ))
(( part0 > 0 )) || { echo "fa4_wheels: the tracked files (${tracked} bytes) leave no room for a carry" >&2; exit 1; }
rm -rf .carry/fa4a .carry/fa4b
mkdir -p .carry/fa4a .carry/fa4b
(cd "$tmp" && sha256sum fa4.tar.xz) > .carry/fa4a/SHA256SUMS
pins=("${MAIN[@]}")
[[ "${FA4_FALLBACK:-0}" == 1 ]] && pins+=("${FALLBACK[@]}")
printf '%s\n' "${pins[@]}" > .carry/fa4a/PINS
head -c "$part0" "$tmp/fa4.tar.xz" > .carry/fa4a/fa4.tar.xz.part0
tail -c +$(( part0 + 1 )) "$tmp/fa4.tar.xz" > .carry/fa4b/fa4.tar.xz.part1
for part in .carry/fa4a .carry/fa4b; do
  b=$(du -sb "$part" | cut -f1)
  awk -v p="$part" -v b="$b" -v t="$tracked" \
      'BEGIN { printf "fa4_wheels: %s %.1f MiB (+ %.1f MiB of tracked files)\n", p, b/1048576, t/1048576 }'
done
b=$(du -sb .carry/fa4b | cut -f1)
(( b + tracked + 9 * 1048576 < 64 * 1048576 )) ||
  echo "fa4_wheels: .carry/fa4b with the tracked files leaves under 9 MiB of a call: carry" \
       "data/embedded (7.9 MiB) in a third call of its own, right after the second" >&2
