#!/usr/bin/env bash
# Here, on the CPU machine with PyPI: FlashAttention 4 (the "fa4" attention backend,
# model/attention_fa4.py) and its dependencies installed for the H200 hosts (Python 3.12, x86_64,
# CUDA 13) into a site folder, packed as one xz tarball (~73 MiB without the fallbacks below) and
# cut into two git-ignored carry folders, each small enough for one device call beside the tracked
# files (the device tool moves 64 MiB per call, tracked files included):
#   .carry/fa4a  the tarball's first part, SHA256SUMS and PINS: 62.5 MiB less the tracked files
#                and .carry/tiktoken (the first call carries [".carry/fa4a", ".carry/tiktoken"])
#   .carry/fa4b  the rest, small enough to go with data/embedded (7.9 MiB) in the second call
#   bash scripts/gpu/fa4_wheels.sh        (from the repo root; ~8 min here, mostly xz)
#   FA4_RECUT=1 bash scripts/gpu/fa4_wheels.sh   (joins the existing parts, checks SHA256SUMS and
#                cuts them again for today's tracked files: seconds, no download)
# Two device calls back to back (a warm machine keeps the first call's ignored paths; the second
# must start within its idle window, ~30 s): the first carries [".carry/fa4a", ".carry/tiktoken"]
# (it may run anything that needs neither fa4 nor data), the second [".carry/fa4b",
# "data/embedded"] and runs `bash scripts/gpu/fa4_install.sh` first (joins, checks, unpacks into
# .fa4_site); then `source .fa4_site/ENV` and python3 imports flash_attn.cute.
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
if [[ "${FA4_RECUT:-0}" == 1 ]]; then
  [[ -f .carry/fa4a/fa4.tar.xz.part0 && -f .carry/fa4b/fa4.tar.xz.part1 && -f .carry/fa4a/SHA256SUMS ]] ||
    { echo "fa4_wheels: FA4_RECUT=1 needs .carry/fa4a and .carry/fa4b from an earlier build; run without it" >&2; exit 2; }
  cat .carry/fa4a/fa4.tar.xz.part0 .carry/fa4b/fa4.tar.xz.part1 > "$tmp/fa4.tar.xz"
  cp .carry/fa4a/PINS "$tmp/PINS"
  (cd "$tmp" && sha256sum -c --quiet "$OLDPWD/.carry/fa4a/SHA256SUMS") ||
    { echo "fa4_wheels: the parts in .carry/ do not match .carry/fa4a/SHA256SUMS; rebuild without FA4_RECUT" >&2; exit 2; }
else
  target "$tmp/fa4/site" "${MAIN[@]}"
  [[ "${FA4_FALLBACK:-0}" == 1 ]] && target "$tmp/fa4/fallback" "${FALLBACK[@]}"
  [[ -f $tmp/fa4/site/flash_attn/cute/interface.py ]] || { echo "fa4_wheels: the install failed" >&2; exit 1; }
  (cd "$tmp" && tar cf - fa4 | xz -T0 -6 > fa4.tar.xz)
  pins=("${MAIN[@]}")
  [[ "${FA4_FALLBACK:-0}" == 1 ]] && pins+=("${FALLBACK[@]}")
  printf '%s\n' "${pins[@]}" > "$tmp/PINS"
fi
# sizes as the disk holds them (du -B1: whole blocks), not byte sums: the device tool counts more
# than the tracked files' bytes (a call was refused at a 63.3 MiB byte sum, 65.5 MiB in blocks)
tracked=$(git ls-files -z | xargs -0 -r du -c -B1 | tail -1 | cut -f1)
tiktoken=$(find .carry/tiktoken -type f -print0 2>/dev/null | xargs -0 -r du -c -B1 | tail -1 | cut -f1 || true)
part0=$(( 62 * 1048576 + 524288 - tracked - ${tiktoken:-0} ))
(( part0 > 0 )) || { echo "fa4_wheels: the tracked files (${tracked} bytes) leave no room for a carry" >&2; exit 1; }
rm -rf .carry/fa4a .carry/fa4b
mkdir -p .carry/fa4a .carry/fa4b
(cd "$tmp" && sha256sum fa4.tar.xz) > .carry/fa4a/SHA256SUMS
cp "$tmp/PINS" .carry/fa4a/PINS
head -c "$part0" "$tmp/fa4.tar.xz" > .carry/fa4a/fa4.tar.xz.part0
tail -c +$(( part0 + 1 )) "$tmp/fa4.tar.xz" > .carry/fa4b/fa4.tar.xz.part1
for part in .carry/fa4a .carry/fa4b; do
  b=$(du -s -B1 "$part" | cut -f1)
  awk -v p="$part" -v b="$b" -v t="$tracked" \
      'BEGIN { printf "fa4_wheels: %s %.1f MiB (+ %.1f MiB of tracked files)\n", p, b/1048576, t/1048576 }'
done
b=$(du -s -B1 .carry/fa4b | cut -f1)
data=$(du -s -B1 data/embedded 2>/dev/null | cut -f1 || true)
(( b + tracked + ${data:-8283750} + 524288 < 64 * 1048576 )) ||
  echo "fa4_wheels: .carry/fa4b with the tracked files leaves no room for data/embedded: carry" \
       "it in a third call of its own, right after the second" >&2
