#!/usr/bin/env bash
# Set up (once), prepare the embedded corpus (if absent), then train.
# With CUDA GPUs: one process per GPU through torchrun, the speedrun preset.
# Without a GPU: the cpu-tiny preset. Extra arguments pass through to the trainer
# (a later --preset overrides the default one).
set -euo pipefail
cd "$(dirname "$0")"
source scripts/env.sh
t1s_setup
t1s_prepare_embedded
num_gpus=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [[ "$num_gpus" -gt 0 ]]; then
  exec "$PY" -m torch.distributed.run --standalone --nproc_per_node="$num_gpus" \
    -m track_1_short.train --preset speedrun "$@"
else
  exec "$PY" -m track_1_short.train --preset cpu-tiny "$@"
fi
