#!/usr/bin/env bash
# Our step at stage C and A with 8 micro-steps (graphs on), and one rank's step of 8 GPUs
# (--micro-steps 1, graphs on and off) at A: the shorter call when the record's timing is already
# measured (scripts/gpu/vs_record.sh) and the device budget left is under 8 minutes.
#   bash scripts/gpu/step_and_host_bound.sh      carry [".carry/tiktoken", "data/embedded-large"]
# Estimated wall, one H200, cold caches: C ~130 s (compile + capture ~80 s), A at 1 micro-step on
# and off ~170 s, A at 8 micro-steps ~60 s (warm cache); ends by DEADLINE_S (default 470 s).
source scripts/gpu/common.sh  # run from the repo root
export DEADLINE_S=${DEADLINE_S:-470}
DATA=${DATA:-data/embedded-large}
step() {  # step NAME LIMIT_S bench/step.py args...
  local name=$1 limit=$2
  shift 2
  (( limit > $(left) - 10 )) && limit=$(( $(left) - 10 ))
  timeout -k 10 "$limit" python3 bench/step.py --steps 20 --data-dir "$DATA" --out "$OUT/$name.json" \
      "$@" > "$L/$name.log" 2>&1
  echo "exit $? after $(elapsed) s (limit $limit s)" >> "$L/$name.log"
  tail -n 2 "$L/$name.log"
}
step step_C 200 --stage C --graphs on --micro-steps 8
step host_bound_step_A 190 --stage A --graphs on,off --micro-steps 1
step step_A 120 --stage A --graphs on --micro-steps 8
pack_outputs
