#!/usr/bin/env bash
# Is one rank's step of the 8-GPU run host-bound, and do the step graphs help there? One H200, one
# device call from the repo root ($OUT: the tool's folder):
#   bash scripts/gpu/host_bound.sh            (STAGES=C: one stage only; default "A C")
#   carry [".carry/tiktoken", "data/embedded-large"] (scripts/gpu/prepare_carry.sh fills them; the
#   carry list of vs_record.sh works too)
# 1. bench/step.py --stage A, then --stage C: --micro-steps 1 (the per-rank work of 8 GPUs: the least
#    GPU work per host call), --graphs on,off (each variant a fresh trainer of that stage alone),
#    20 timed steps + PROFILE_STEPS profiled (default 8: the window's start, when the queue may be
#    empty, then weighs ~4x less in gpu_busy than with bench/step.py's default 2; their traces kept
#    in the logs: trace_<stage>_<graphs>.json.gz, where the gaps between kernels show); one after
#    the other (timing);
# 2. bench/host_bound.py -> $OUT/host_bound_${MACHINE}_<date>.json; the raw JSON beside it
#    (host_bound_step_A.json, host_bound_step_C.json), the logs in results.tgz.
# Estimated wall, one H200: ~270 s with cold caches (per stage: graphs on compiles and captures the
# key, 88 s at A and 76 s at C cold per docs/results/README.md, plus ~20 s of start-up and preflight;
# graphs off re-traces against the warm inductor cache, ~20 s warm compile + ~20 s start-up; 22 steps
# of one micro-step take ~1-2 s); ~150 s right after vs_record.sh on the same warm machine (the
# same keys: same shapes and document capacities). Each stage has a time limit (ends by DEADLINE_S,
# 585 s). OURS_SET="SECTION.FIELD=VALUE ..." passes --set items to every run (e.g.
# OURS_SET="train.ngram_rows_in_step=false": the n-gram rows around the step, as before 2026-12-02).
# With fa4 or quack in OURS_SET the packages come as in vs_record.sh (.carry/fa4a on the machine
# from an earlier call, this call carries .carry/fa4b; DATA=data/embedded keeps it under 64 MiB).
source scripts/gpu/common.sh  # run from the repo root
DATA=${DATA:-data/embedded-large} MACHINE=${MACHINE:-h200}
DATE=$(date -u +%F)
STAGES=${STAGES:-A C}  # e.g. STAGES=C (bench/host_bound.py --stages follows)
ours_set=()
for item in ${OURS_SET:-}; do ours_set+=(--set "$item"); done
use_fa4_packages_for "${OURS_SET:-}"
for stage in $STAGES; do  # the first of two gets half of what is left, the last the rest
  limit=$(( $(left) - 15 ))
  [[ $stage == "${STAGES%% *}" && $STAGES == *" "* ]] && limit=$(( limit / 2 ))
  timeout -k 10 "$limit" python3 bench/step.py --stage "$stage" --steps 20 --graphs on,off --micro-steps 1 \
      --profile-steps "${PROFILE_STEPS:-8}" --data-dir "$DATA" --trace-dir "$L" --out "$OUT/host_bound_step_$stage.json" "${ours_set[@]}" \
      > "$L/host_bound_step_$stage.log" 2>&1
  echo "exit $? after $(elapsed) s (limit $limit s)" >> "$L/host_bound_step_$stage.log"
done
steps=()
for stage in $STAGES; do steps+=(--step "$OUT/host_bound_step_$stage.json"); done
python3 bench/host_bound.py "${steps[@]}" --stages "${STAGES// /,}" --machine "$MACHINE" --date "$DATE" \
    --out-dir "$OUT" --script "STAGES='$STAGES' OURS_SET='${OURS_SET:-}' bash scripts/gpu/host_bound.sh" 2>&1 | tee "$L/host_bound.log"
echo "host_bound.sh: done after $(elapsed) s" | tee -a "$L/host_bound.log"
pack_outputs
