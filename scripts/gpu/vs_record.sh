#!/usr/bin/env bash
# Our training step against the record's at stage C or A (the record's stage 2 or 0: the same
# per-micro-step shapes), one H200, one device call per stage from the repo root ($OUT: the tool's
# folder):
#   STAGES=C bash scripts/gpu/vs_record.sh        (then STAGES=A in a second call)
#   carry [".carry/anchor_src", ".carry/anchor_modded", ".carry/tiktoken", "data/embedded-large"]
#   (scripts/gpu/prepare_carry.sh fills them on the CPU machine)
# 1. the record's harness: `run.sh timing TIMING_STAGES=<its index of each stage>` (per stage:
#    compile, settle, 10 steady steps timed with CUDA events, 2 synced, 2 under the profiler) on the
#    shards ours uses (DATA); RECORD_DATA=synthetic gives it its own random shards instead, as in
#    its RESULTS.md;
# 2. ours, after it and one after the other (never beside it: timing): bench/step.py --stage S for
#    each S in STAGES, 8 micro-steps, graphs on, 20 timed steps + 2 profiled;
# 3. bench/vs_record.py -> $OUT/vs_record_${MACHINE}_<date>[_<stages>].json (the stages in the
#    name when not both); the raw JSON beside it (step_<S>.json, record_timing.json), every log in
#    results.tgz.
# One stage per call (the default, STAGES=C): cold, both stages do not fit one call's 600 s.
# Measured 2026-12-01 on one H200: the record compiled its stage 0 in 154 s and had not finished
# stage 2 after 358 s; ours takes ~130 s cold per stage (compile + capture + self-check + 22
# steps). STAGES="A C" fits only a machine whose caches are warm for both (the same machine within
# its idle window: the record's caches stay in .carry/anchor_work, ours in build/inductor_cache).
# OURS_PROFILE=record runs ours with --model-profile record (the record's architecture, whose
# loss matched the record's: the like-for-like step); OURS_SET="SECTION.FIELD=VALUE ..." passes
# --set items to ours (after the profile), e.g. the winners of
# fp8_step.sh: OURS_SET="model.attention_backend=fa4 train.mlp_kernel=quack". With fa4 or quack
# the packages come as in fp8_step.sh (the call before carries [".carry/fa4a"]; this one adds
# ".carry/fa4b" and, to stay under 64 MiB, DATA=data/embedded instead of data/embedded-large,
# unless the machine still holds data/embedded-large from an earlier call). Every step has a time
# limit, so the call ends by DEADLINE_S (585 s) and still returns what finished.
source scripts/gpu/common.sh  # run from the repo root
DATA=${DATA:-data/embedded-large} MACHINE=${MACHINE:-h200} STAGES=${STAGES:-C}
RECORD_DATA=${RECORD_DATA:-$DATA}
DATE=$(date -u +%F)
record_data=()
[[ "$RECORD_DATA" == synthetic ]] || record_data=("TIMING_DATA_DIR=$RECORD_DATA")

record_index=() ours_json=() n=0
for stage in $STAGES; do
  case "$stage" in
    A) record_index+=(0) ;;
    C) record_index+=(2) ;;
    *) echo "vs_record.sh: STAGES holds '$stage'; the stages compared are A and C (e.g. STAGES=C)" >&2; exit 2 ;;
  esac
  ours_json+=(--ours "$OUT/step_$stage.json")
  n=$(( n + 1 ))
done
(( n > 0 )) || { echo "vs_record.sh: STAGES is empty; set STAGES=C or STAGES=A" >&2; exit 2; }
ours_set=(--model-profile "${OURS_PROFILE:-default}")
for item in ${OURS_SET:-}; do ours_set+=(--set "$item"); done
use_fa4_packages_for "${OURS_SET:-}"

# the record gets at most what leaves ours ~140 s per stage (a cold stage of ours needs ~130 s)
record_limit=$(( $(left) - 140 * n ))
(( record_limit > 420 )) && record_limit=420
run_anchor timing "$record_limit" TIMING_STAGES="$(IFS=,; echo "${record_index[*]}")" "${record_data[@]}"
cp "$OUT/anchor/timing.json" "$OUT/record_timing.json" 2>/dev/null
i=0
for stage in $STAGES; do  # each of ours gets an equal share of what is left
  limit=$(( ($(left) - 15) / (n - i) ))
  timeout -k 10 "$limit" python3 bench/step.py --stage "$stage" --steps 20 --graphs on --micro-steps 8 \
      --data-dir "$DATA" "${ours_set[@]}" --out "$OUT/step_$stage.json" > "$L/step_$stage.log" 2>&1
  echo "exit $? after $(elapsed) s (limit $limit s)" >> "$L/step_$stage.log"
  i=$(( i + 1 ))
done
python3 bench/vs_record.py --record "$OUT/anchor/timing.json" "${ours_json[@]}" \
    --stages "${STAGES// /,}" --machine "$MACHINE" --date "$DATE" --out-dir "$OUT" \
    --script "STAGES='$STAGES' ${OURS_PROFILE:+OURS_PROFILE=$OURS_PROFILE }${OURS_SET:+OURS_SET='$OURS_SET' }bash scripts/gpu/vs_record.sh" 2>&1 | tee "$L/vs_record.log"
echo "vs_record.sh: done after $(elapsed) s" | tee -a "$L/vs_record.log"
pack_outputs anchor
