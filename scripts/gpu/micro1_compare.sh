#!/usr/bin/env bash
# The small-gpu preset at one micro-step per step (each step one rank's work of the 8-GPU run),
# graphs on against graphs off back to back, compared with `report compare`. One H200, two device
# calls on one warm machine, from the repo root:
#   bash scripts/gpu/micro1_compare.sh warmup   compile + capture every key and validation window
#                                               (--warmup-only; ~380 s cold), filling the caches
#   bash scripts/gpu/micro1_compare.sh run      graphs on, then off (188 steps each), then report
#                                               compare -> $OUT/compare/; within the warm window
#                                               each re-traces against the warm caches, and on a
#                                               cold machine too it fits one call: on may take all
#                                               but OFF_RESERVE_S (170 s: the warm off run took
#                                               124 s on an H100), off takes what on leaves
#   bash scripts/gpu/micro1_compare.sh on|off   one run alone, cold or warm (the whole call's deadline),
#                                               for when the warm window between calls is lost: the
#                                               two run dirs come back and `report compare` runs here
#   carry [".carry/tiktoken", "data/embedded"]
# Both runs: `track_1_short.train --preset small-gpu --micro-steps 1 --no-save-final` (the
# optimizer then works on whole banks, not a 1/8 shard; the global batch is one slice per step, so
# the loss is not comparable with the 8-micro-step preset's). Deadlines from the call's
# (DEADLINE_S, 585 s) as above; a cut run leaves its log and run dir so far.
source scripts/gpu/common.sh  # run from the repo root
MODE=${1:-run}
common=(--preset small-gpu --micro-steps 1 --runs-dir "$OUT/runs" --no-save-final)
micro1_train() {  # ID LIMIT_S FLAGS...: one run, its log in $L
  local id=$1 limit=$2
  shift 2
  timeout -k 15 "$limit" python3 -m track_1_short.train "${common[@]}" --run-id "$id" "$@" \
      > "$L/$id.log" 2>&1
  echo "exit $? after $(elapsed) s (limit $limit s)" >> "$L/$id.log"
}
case "$MODE" in
  warmup) micro1_train micro1-warmup $(( $(left) - 10 )) --graphs on --warmup-only ;;
  run)
    micro1_train micro1-on $(( $(left) - 20 - ${OFF_RESERVE_S:-170} )) --graphs on
    micro1_train micro1-off $(( $(left) - 20 )) --graphs off
    python3 -m track_1_short.report compare --run "graphs_on=$OUT/runs/micro1-on" \
        --run "graphs_off=$OUT/runs/micro1-off" --out "$OUT/compare" 2>&1 | tee "$L/compare.log" ;;
  on|off) micro1_train "micro1-$MODE" $(( $(left) - 10 )) --graphs "$MODE" ;;
  *) echo "micro1_compare.sh: MODE is warmup, run, on or off, not '$MODE'" >&2; exit 2 ;;
esac
echo "micro1_compare.sh $MODE: done after $(elapsed) s" | tee -a "$L/compare.log"
pack_outputs  # compare/ stays beside results.tgz
