#!/usr/bin/env bash
# A candidate setting tried at stage C, then our fast step against the record's at A and C with
# it where it won: device calls on one warm machine (each within the one before's idle window,
# ~30 s), from the repo root ($OUT: the tool's folder):
#   CANDIDATE="SECTION.FIELD=VALUE ..." bash scripts/gpu/choose_then_vs_record.sh choose
#       carry [".carry/anchor_src", ".carry/anchor_modded", ".carry/tiktoken", "data/embedded"]
#       (with .carry/fa4a too it is over the device tool's 64 MiB since the tracked files reached
#       ~15 MiB on disk: send .carry/fa4a alone in a call between the two, e.g. the candidate's
#       GPU tests; a warm machine keeps the ignored paths a call does not name): 1. the record's
#       timing at its stages 0 and 2 (its compile caches in .carry/anchor_work, for compare); 2. ours at C (8 micro-steps, graphs on; the fp8
#       lm head in the recompute schedule with the default attention and MLP: fa4 and quack come
#       only with the second call's carry) as it is, then with each --set item of CANDIDATE (none:
#       the baseline alone, and compare runs the fast set as it is); both
#       JSONs to $OUT and to build/choose/ (kept by the warm machine), the baseline's trace too.
#       BASE_EXTRA="SECTION.FIELD=VALUE ...": --set items already chosen (e.g. by a kernel
#       benchmark before this call), in the baseline, the candidate and compare's fast set alike.
#   bash scripts/gpu/choose_then_vs_record.sh compare
#       carry [".carry/fa4b"] (the rest is still on the machine from the calls before):
#       scripts/gpu/vs_record.sh at A and C with FlashAttention 4, the quack
#       MLP and the fp8 lm head (recompute), plus CANDIDATE (as build/choose/ recorded it) where
#       the first call measured it at least MIN_GAIN (default 0.003) faster at C with at most 60 s
#       more warmup, and the first call's BASE_EXTRA; the choice in $OUT/choice.txt, the --set
#       items run in build/choose/fast_set.txt. PRE_TESTS="tests/test_x_gpu.py ...": GPU test files
#       run first (run_gpu_tests, 150 s at most, log gpu_tests.log), e.g. the candidate kernel's.
# Measured 2026-12-03 (as docs/results/scripts/lease15_call1.sh and call2.sh): choose took 583 s
# (the record's warm-up ~250 s, a cold baseline 115 s), compare 503 s.
source scripts/gpu/common.sh  # run from the repo root
MODE=${1:-}
# the fp8 lm head in the recompute schedule (both calls), and fa4 + quack (the second call's carry)
HEAD="model.fp8.enabled=true model.fp8.sites=lm_head train.fused_loss_schedule=recompute"
FAST="model.attention_backend=fa4 train.mlp_kernel=quack $HEAD"
case "$MODE" in
  choose)
    run_anchor timing 250 TIMING_STAGES=0,2
    cp "$OUT/anchor/timing.json" "$OUT/record_warm_timing.json" 2>/dev/null
    rm -rf build/choose && mkdir -p build/choose "$OUT/traces"
    echo "${CANDIDATE:-}" > build/choose/candidate.txt
    echo "${BASE_EXTRA:-}" > build/choose/base_extra.txt
    base=(--stage C --steps 20 --graphs on --micro-steps 8 --data-dir data/embedded)
    for item in $HEAD ${BASE_EXTRA:-}; do base+=(--set "$item"); done
    cand=()
    for item in ${CANDIDATE:-}; do cand+=(--set "$item"); done
    timeout -k 10 170 python3 bench/step.py "${base[@]}" --trace-dir "$OUT/traces" \
        --out "$OUT/c_base.json" > "$L/c_base.log" 2>&1
    echo "exit $? after $(elapsed) s" >> "$L/c_base.log"
    if [[ -n "${CANDIDATE:-}" ]]; then  # without one: the record's warm-up and the baseline only
      timeout -k 10 $(( $(left) - 10 )) python3 bench/step.py "${base[@]}" "${cand[@]}" \
          --out "$OUT/c_candidate.json" > "$L/c_candidate.log" 2>&1
      echo "exit $? after $(elapsed) s" >> "$L/c_candidate.log"
    fi
    cp "$OUT"/c_*.json build/choose/ 2>/dev/null
    tail -n 3 "$L"/c_*.log
    pack_outputs anchor ;;
  compare)
    mkdir -p build/choose
    candidate=$(cat build/choose/candidate.txt 2>/dev/null)
    base_extra=$(cat build/choose/base_extra.txt 2>/dev/null)
    won=$(MIN_GAIN=${MIN_GAIN:-0.003} python3 - <<'PY'
import json, os
try:
    b, c = (json.load(open(f"build/choose/c_{n}.json"))["variants"]["on"] for n in ("base", "candidate"))
    gain = 1 - c["step_ms"]["median_ms"] / b["step_ms"]["median_ms"]
    ok = gain >= float(os.environ["MIN_GAIN"]) and c["warmup_s"] - b["warmup_s"] <= 60
    print(f"{'yes' if ok else 'no'} (gain {gain:.4f}, warmup {b['warmup_s']:.0f} -> {c['warmup_s']:.0f} s)")
except (OSError, KeyError, ValueError) as e:
    print(f"no (the first call's JSON: {type(e).__name__} {e})")
PY
)
    echo "candidate '${candidate:-none}': $won; base extra '${base_extra}'" | tee "$OUT/choice.txt"
    set_items="$FAST $base_extra"
    [[ "$won" == yes* ]] && set_items="$set_items $candidate"
    echo "$set_items" > build/choose/fast_set.txt  # what the runs after this one take as the fast set
    if [[ -n "${PRE_TESTS:-}" ]]; then run_gpu_tests "$L/gpu_tests.log" 150 ${PRE_TESTS} -s; fi
    # vs_record.sh counts its deadline from its own start: less what this call has used
    DEADLINE_S=$(( ${DEADLINE_S:-585} - $(elapsed) )) STAGES="A C" DATA=data/embedded \
        OURS_SET="$set_items" bash scripts/gpu/vs_record.sh ;;
  *) echo "choose_then_vs_record.sh: MODE is choose or compare, not '$MODE'" >&2; exit 2 ;;
esac
