#!/usr/bin/env bash
# One trainer run on the device machine: `bash scripts/gpu/run_preset.sh PRESET NGPUS MODE`, MODE one
# of warmup (compile + capture every key, then exit: --warmup-only), on, off (--graphs on|off).
# A cold compile of the speedrun keys takes ~380-390 s, so a run that does not fit one 10-minute device
# command goes as two calls on the same machine: `warmup`, then, within the device tool's 30 s warm
# window, `on` (or `off`): build/inductor_cache stays on the warm machine's disk between calls.
# On 8 GPUs: `run_preset.sh speedrun 8 warmup`, then `on`, then `off` within the warm windows (the
# 2-GPU timings of these calls are in docs/results/README.md, "speedrun_2gpu_h200_2026-11-30").
# Needs $OUT; results land in $OUT (logs and runs packed into results.tgz).
source "$(dirname "$0")/common.sh"
run_trainer "${1:?usage: run_preset.sh PRESET NGPUS warmup|on|off}" "${2:?}" "${3:?}"
pack_outputs
