#!/usr/bin/env bash
# Our training step against the record's at stages A and C (the record's stages 0 and 2: the same
# per-micro-step shapes), one H200, one device call from the repo root ($OUT: the tool's folder):
#   bash scripts/gpu/vs_record.sh
#   carry [".carry/anchor_src", ".carry/anchor_modded", ".carry/tiktoken", "data/embedded-large"]
#   (scripts/gpu/prepare_carry.sh fills them on the CPU machine)
# 1. the record's harness: `run.sh timing TIMING_STAGES=0,2` (per stage: compile, settle, 10 steady
#    steps timed with CUDA events, 2 synced, 2 under the profiler) on the shards ours uses (DATA);
#    RECORD_DATA=synthetic gives it its own random shards instead, as in its RESULTS.md;
# 2. ours, after it and one after the other (never beside it: timing): bench/step.py --stage A,
#    then --stage C, 8 micro-steps, graphs on, 20 timed steps + 2 profiled;
# 3. bench/vs_record.py -> $OUT/vs_record_${MACHINE}_<date>.json; the raw JSON beside it
#    (step_A.json, step_C.json, record_timing.json), every log in results.tgz.
# OURS_SET="SECTION.FIELD=VALUE ..." passes --set items to ours (both stages), e.g. the winners of
# fp8_step.sh: OURS_SET="model.attention_backend=fa4 train.mlp_kernel=quack". With fa4 or quack
# the packages come as in fp8_step.sh (the call before carries [".carry/fa4a"]; this one adds
# ".carry/fa4b" and, to stay under 64 MiB, DATA=data/embedded instead of data/embedded-large).
# Estimated wall, one H200: ~560 s with cold compile caches: the record ~300 s (RESULTS.md run B:
# 295 s for stages 0 and 2, almost all compiling), ours A ~130 s and C ~120 s (small-gpu's cold
# compile + capture 88 s at A and 76 s at C, docs/results/README.md, plus start-up, preflight and
# 22 steps of 0.29 / 0.84 s); ~250 s warm (the same machine within its warm window: the record's
# caches stay in .carry/anchor_work, ours in build/inductor_cache). Every step has a time limit, so
# the call ends by DEADLINE_S (585 s) and still returns what finished.
source scripts/gpu/common.sh  # run from the repo root
DATA=${DATA:-data/embedded-large} MACHINE=${MACHINE:-h200}
RECORD_DATA=${RECORD_DATA:-$DATA}
DATE=$(date -u +%F)
record_data=()
[[ "$RECORD_DATA" == synthetic ]] || record_data=("TIMING_DATA_DIR=$RECORD_DATA")

ours_set=()
for item in ${OURS_SET:-}; do ours_set+=(--set "$item"); done
if [[ "${OURS_SET:-}" =~ (fa4|quack) ]]; then
  use_fa4_packages
fi

run_anchor timing 320 TIMING_STAGES=0,2 "${record_data[@]}"
cp "$OUT/anchor/timing.json" "$OUT/record_timing.json" 2>/dev/null
for stage in A C; do  # A gets what is left but C's ~140 s (a cold A needs ~130 s), C the rest
  limit=$(( $(left) - 15 ))
  [[ $stage == A ]] && limit=$(( limit - 140 > limit / 2 ? limit - 140 : limit / 2 ))
  timeout -k 10 "$limit" python3 bench/step.py --stage "$stage" --steps 20 --graphs on --micro-steps 8 \
      --data-dir "$DATA" "${ours_set[@]}" --out "$OUT/step_$stage.json" > "$L/step_$stage.log" 2>&1
  echo "exit $? after $(elapsed) s (limit $limit s)" >> "$L/step_$stage.log"
done
python3 bench/vs_record.py --record "$OUT/anchor/timing.json" --ours "$OUT/step_A.json" \
    --ours "$OUT/step_C.json" --machine "$MACHINE" --date "$DATE" --out-dir "$OUT" \
    --script "${OURS_SET:+OURS_SET='$OURS_SET' }bash scripts/gpu/vs_record.sh" 2>&1 | tee "$L/vs_record.log"
echo "vs_record.sh: done after $(elapsed) s" | tee -a "$L/vs_record.log"
pack_outputs anchor
