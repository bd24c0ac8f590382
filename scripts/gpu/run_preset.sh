#!/usr/bin/env bash
# One trainer run on the device machine: `bash scripts/gpu/run_preset.sh PRESET NGPUS MODE`, MODE one
# of warmup (compile + capture every key, then exit: --warmup-only), on, off (--graphs on|off).
# A cold compile of the speedrun keys takes ~380 s, so a run that does not fit one 10-minute device
# command goes as two calls on the same machine: `warmup`, then, within the device tool's 30 s warm
# window, `on` (or `off`): build/inductor_cache stays on the warm machine's disk between calls.
# Needs $OUT; results land in $OUT (logs and runs packed into results.tgz).
source "$(dirname "$0")/common.sh"
preset=${1:?usage: run_preset.sh PRESET NGPUS warmup|on|off} ngpus=${2:?} mode=${3:?}
case "$mode" in
  warmup) flags=(--graphs on --warmup-only) ;;
  on|off) flags=(--graphs "$mode") ;;
  *) echo "run_preset.sh: MODE must be warmup, on or off, got '$mode'" >&2; exit 2 ;;
esac
id="$preset-${ngpus}gpu-$mode"
timeout 580 python3 -m torch.distributed.run --standalone --nproc_per_node "$ngpus" -m track_1_short.train --preset "$preset" \
    "${flags[@]}" --run-id "$id" --runs-dir "$OUT/runs" --no-save-final > "$L/$id.log" 2>&1
echo "exit $? after $(elapsed) s" >> "$L/$id.log"
pack_outputs
