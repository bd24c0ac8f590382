#!/usr/bin/env bash
# Our val loss against the record's on the same corpus, schedule and validation tokens, one H200,
# one device call from the repo root ($OUT: the tool's folder):
#   bash scripts/gpu/loss_parity.sh [run|warmup]      (MAX_STEPS=N: ours stops after N steps;
#   VARIANT=NAME: ours with a variant's flags, scripts/gpu/loss_variants.sh, e.g. head_mudd)
#   carry [".carry/anchor_src", ".carry/anchor_modded", ".carry/tiktoken", "data/embedded-large"]
#   (scripts/gpu/prepare_carry.sh fills them on the CPU machine)
# run (default), the two trainers side by side (loss does not depend on timing, and one after the
# other would not fit the call):
# - the record's harness, `run.sh loss` on data/embedded-large with our small-gpu schedule, Muon
#   momentum ramp and validation (bench/loss_parity.py anchor-args reads them from our preset:
#   ITERS=180 EXT_ITERS=8 MUON_WARMUP=40 MUON_COOLDOWN=10 VAL_EVERY=10 VAL_SEQ=32768
#   VAL_TOKENS=196608, i.e. stage boundaries 60/120/180/188), VAL_BACKEND=aot_eager (cheaper eval
#   compile; eager bf16 numerics in its validation, PATCHES.md);
# - ours, `track_1_short.train --preset small-gpu --graphs on` on the same shards, validation every
#   10 steps on the same tokens (the same val shard, 6 batches of 32,768 = the first 196,608 + 1),
#   at a stage's first step in the new stage's windows and YaRN state as the record validates
#   (--set schedule.stage_start_validation=next; runs before 2026-12-02 validated steps 60, 120
#   and 180 in the windows trained so far),
#   the train objective logged every step (the stage transitions); MAX_STEPS=N cuts ours after N
#   steps of the same schedule (--max-steps: only the keys and validation windows of those steps
#   compile), e.g. MAX_STEPS=110 for the points before the data repeats (step ~103-107 on
#   embedded-large) on a cold machine, where both full runs do not fit one call;
# then bench/loss_parity.py build -> $OUT/loss_parity_embedded-large_<date>.json (with a VARIANT
# other than base: loss_parity_embedded-large_<VARIANT>_<date>.json) and `report
# compare --record` -> $OUT/compare/ (compare.json, val_loss_compare.png); run dir, the record's
# loss.jsonl / loss.json and the logs in results.tgz.
# warmup: fills both compile caches for a following `run` on the same machine (within its warm
# window): the record's `run.sh timing TIMING_STAGES=0,1,2,3` on the same shards (its training
# graphs are the loss run's: PATCHES.md P5; its timing.json comes back as record_timing_4stages.json,
# taken beside our compile, so not a clean timing) and our same command with --warmup-only.
# Estimated wall, one H200: run with cold caches ~650-700 s, over the call: the record's warmup
# compiles every stage (380 s in RESULTS.md run A) and trains 188 steps (~100 s alone at its
# ~0.34 / 0.45 / 0.66 s per step in stages 0 / 1 / 2), ours compiles 4 keys and 4 validation
# windows (380 s cold) and trains ~107 s, and the two share the CPU while compiling and the GPU
# while training. So on a cold machine call `warmup` first (~500 s: the record's 4-stage timing
# ~450 s alone, ours 380 s, both slower side by side), then `run` (~350-400 s warm: both warmups
# re-trace against warm caches, ~100-150 s, then ~150 s of shared-GPU training each). After
# vs_record.sh and host_bound.sh on the same warm machine, stages A/0 and C/2 are already compiled.
# Both trainers have time limits (end by DEADLINE_S, 585 s); a cut run still leaves its curve so far.
# One run per side cannot decide a 0.02 margin (one validation gap has sd ~0.02, measured
# 2026-12-02): repeat `run` in later calls on the warm machine (one pair per call, ~300 s) and
# pool the pairs on the CPU, `bench/loss_parity.py pool --ours RUN --ours RUN ... --record
# LOSS.jsonl --record LOSS.jsonl ...` (the mean gap, each side's run-to-run sd, the standard error).
source scripts/gpu/common.sh  # run from the repo root
source scripts/gpu/loss_variants.sh  # loss_variant_flags, parity_train_cmd
MODE=${1:-run} VARIANT=${VARIANT:-base}
DATA=${DATA:-data/embedded-large} VAL_EVERY=${VAL_EVERY:-10}
DATE=$(date -u +%F)
case "$MODE" in run|warmup) ;; *) echo "loss_parity.sh: MODE is run or warmup, not '$MODE'" >&2; exit 2 ;; esac
variant_args=$(loss_variant_flags "$VARIANT") || exit 2
read -r -a VARIANT_ARGS <<< "$variant_args"
args_line=$(python3 bench/loss_parity.py anchor-args --preset small-gpu --data-dir "$DATA" \
            --val-every "$VAL_EVERY" 2> "$L/anchor_args.log") || { cat "$L/anchor_args.log" >&2; exit 2; }
read -r -a ANCHOR_ARGS <<< "$args_line"
for kv in "${ANCHOR_ARGS[@]}"; do
  case "$kv" in VAL_SEQ=*) VAL_SEQ=${kv#*=} ;; VAL_TOKENS=*) VAL_TOKENS=${kv#*=} ;; esac
done
echo "record settings: ${ANCHOR_ARGS[*]}" | tee "$L/settings.log"
id=small-gpu-parity
[[ $VARIANT == base ]] || id+=-$VARIANT
parity_train_cmd "$DATA" "$VAL_EVERY" "$VAL_TOKENS" "$VAL_SEQ"
ours=("${PARITY_TRAIN[@]}" ${MAX_STEPS:+--max-steps "$MAX_STEPS"} "${VARIANT_ARGS[@]}")
echo "ours: ${ours[*]}" | tee -a "$L/settings.log"

# OURS_RUNS=N: ours N times one after the other beside the record's one run (run ids $id,
# $id-r2, ...; in warmup $id-w1, ...; each but a run's first starts only with OURS_MIN_S left).
# Ours takes ~150 s warm with MAX_STEPS=110, the record ~295 s for its 188 steps, so two of ours
# fit beside it for the pooled comparison (2026-12-02: 326-343 s per call). In warmup (default 0)
# they follow ours' --warmup-only while the record's 4-stage timing runs on (517 s with one).
OURS_MIN_S=${OURS_MIN_S:-200}
if [[ "$MODE" == warmup ]]; then OURS_RUNS=${OURS_RUNS:-0}; else OURS_RUNS=${OURS_RUNS:-1}; fi
ours_runs() {
  local i rid
  for (( i = 1; i <= OURS_RUNS; i++ )); do
    rid=$id
    [[ $MODE == warmup ]] && rid=$id-w$i
    [[ $MODE == run && $i -gt 1 ]] && rid=$id-r$i
    if [[ $MODE == warmup || $i -gt 1 ]] && (( $(left) < OURS_MIN_S )); then
      echo "ours: skipped $rid, $(left) s left (OURS_MIN_S=$OURS_MIN_S)" | tee -a "$L/settings.log"
      return 0
    fi
    timeout -k 15 $(( $(left) - 25 )) "${ours[@]}" --run-id "$rid" > "$L/$rid.log" 2>&1
    echo "ours: $rid exit $? after $(elapsed) s" | tee -a "$L/settings.log"
  done
}
if [[ "$MODE" == warmup ]]; then
  run_anchor timing $(( $(left) - 40 )) TIMING_STAGES=0,1,2,3 "TIMING_DATA_DIR=$DATA" &
  { timeout -k 15 $(( $(left) - 20 )) "${ours[@]}" --warmup-only --run-id "$id-warmup" > "$L/$id-warmup.log" 2>&1
    ours_runs; } &
  wait
  cp "$OUT/anchor/timing.json" "$OUT/record_timing_4stages.json" 2>/dev/null
  echo "loss_parity.sh warmup: done after $(elapsed) s" | tee -a "$L/settings.log"
  pack_outputs anchor
  exit 0
fi

run_anchor loss $(( $(left) - 40 )) "DATA_DIR=$DATA" VAL_BACKEND=aot_eager "${ANCHOR_ARGS[@]}" &
ours_runs &
wait
echo "both runs ended after $(elapsed) s" | tee -a "$L/settings.log"
variant_opt=()
[[ $VARIANT == base ]] || variant_opt=(--variant "$VARIANT")
python3 bench/loss_parity.py build --ours "$OUT/runs/$id" --record "$OUT/anchor" --data-dir "$DATA" \
    "${variant_opt[@]}" --date "$DATE" --out-dir "$OUT" \
    --script "VARIANT=$VARIANT bash scripts/gpu/loss_parity.sh" 2>&1 | tee "$L/loss_parity.log"
python3 -m track_1_short.report compare --run "ours=$OUT/runs/$id" --record "$OUT/anchor/loss.jsonl" \
    --out "$OUT/compare" 2>&1 | tee -a "$L/loss_parity.log"
echo "loss_parity.sh: done after $(elapsed) s" | tee -a "$L/loss_parity.log"
pack_outputs anchor
