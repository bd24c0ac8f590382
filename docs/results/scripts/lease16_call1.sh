#!/usr/bin/env bash
# Sixteenth lease, call 1 (one H200; carry [".carry/fa4a", ".carry/anchor_src",
# ".carry/anchor_modded", ".carry/tiktoken", "data/embedded"]), from the repo root with $OUT set:
#   bash docs/results/scripts/lease16_call1.sh
# 1. the hold's vector-atomic row accumulation (kernels/row_accumulate.py, row_accumulate_vector_):
#    its GPU tests, then bench/ngram_hold.py at C and A (index_add_, both kernels, the hold three
#    ways); where the hold through it is at most 0.9x the default hold's median at C, the step
#    takes it (BASE_EXTRA="train.ngram_accumulate=vector_atomic"; the hold runs inside the step
#    graph's backward, so its kernel time is the step's);
# 2. scripts/gpu/choose_then_vs_record.sh choose with CANDIDATE="train.inductor_pdl=true" on top
#    of that baseline, in what is left of the call (DEADLINE_S less step 1's seconds).
# Call 2 right after, within the machine's ~30 s idle window: bash
# scripts/gpu/choose_then_vs_record.sh compare, carry [".carry/fa4b", ".carry/anchor_src",
# ".carry/anchor_modded", ".carry/tiktoken", "data/embedded"].
source scripts/gpu/common.sh
run_gpu_tests "$L/row_accumulate_gpu_tests.log" 90 -s tests/test_row_accumulate_gpu.py
tests_rc=$(tail -n 1 "$L/row_accumulate_gpu_tests.log")
for stage in C A; do
  timeout -k 5 60 python3 bench/ngram_hold.py --stage $stage --data-dir data/embedded \
      --out "$OUT/ngram_hold_$stage.json" > "$L/ngram_hold_$stage.log" 2>&1
  echo "exit $? after $(elapsed) s" >> "$L/ngram_hold_$stage.log"
  cat "$L/ngram_hold_$stage.log"
done
extra=$(TESTS="$tests_rc" python3 - "$OUT/ngram_hold_C.json" <<'PY'
import json, os, sys
try:
    ops = json.load(open(sys.argv[1]))["ops_ms"]
    ratio = ops["hold_vector_atomic"]["median_ms"] / ops["hold"]["median_ms"]
except (OSError, KeyError, ValueError) as e:
    print(f"# no ngram_hold_C.json: {type(e).__name__} {e}", file=sys.stderr)
    sys.exit(0)
ok = ratio <= 0.9 and os.environ["TESTS"].startswith("exit 0")
print(f"# hold_vector_atomic / hold at C: {ratio:.3f}; GPU tests: {os.environ['TESTS']}", file=sys.stderr)
print("train.ngram_accumulate=vector_atomic" if ok else "")
PY
)
echo "BASE_EXTRA='$extra' after $(elapsed) s" | tee "$L/base_extra.txt"
used=$(elapsed)
cp "$L"/row_accumulate_gpu_tests.log "$L"/ngram_hold_*.log "$L/base_extra.txt" "$OUT/" 2>/dev/null
DEADLINE_S=$(( ${DEADLINE_S:-585} - used )) BASE_EXTRA="$extra" CANDIDATE="train.inductor_pdl=true" \
    bash scripts/gpu/choose_then_vs_record.sh choose
