#!/usr/bin/env bash
# Polar Express on quack's GEMMs (optim.polar_gemms=quack, kernels/polar_gemms.py), one H200 (planned,
# not run yet). Carry [".carry/fa4b"] in the call right after one that carried .carry/fa4a
# (scripts/gpu/fa4_wheels.sh: quack-kernels comes with flash-attn-4's wheels). The GPU tests
# (tests/test_polar_gemms_gpu.py: bf16 error against float64 no worse than 1.05x torch's at the
# three bank shapes, eager and compiled; a captured compiled call replays equal to the compiled
# call; the compiled bank step), then bench/polar_express.py (torch against quack per bank,
# compiled, device time per call) into $OUT/polar_express.json; then, where >= 300 s are left, the
# whole optimizer step compiled (bench/optimizer.py --compile on --untied) with torch's and with
# quack's GEMMs, each in half the time left ($OUT/optimizer_{torch,quack}.json: step_ms.even).
# Prediction: quack saves ~0.4-0.6 ms per even optimizer step (the baddbmm memcpys of x, 0.41 ms,
# and of the Gram matrices, 0.16 ms, gone: saving_ms_per_even_step in the JSON), more if
# gemm_symmetric's one-triangle schedule is efficient at N = 768 and 256; the error ratios ~1.0.
# Unknowns only the GPU settles: whether quack takes the MN-major operands (x.mT for the tall
# Gram matrix, x as gemm_add's B) in bf16 without a copy or a refusal.
source scripts/gpu/common.sh
use_fa4_packages
run_gpu_tests "$L/gpu_tests.log" 240 tests/test_polar_gemms_gpu.py -s
timeout -k 15 $(( $(left) - 20 )) python3 bench/polar_express.py --out "$OUT/polar_express.json" \
    > "$L/polar_express.log" 2>&1
echo "exit $? after $(elapsed) s" >> "$L/polar_express.log"
tail -n 8 "$L/polar_express.log"
if (( $(left) >= 300 )); then
  half=$(( ($(left) - 20) / 2 ))
  for gemms in torch quack; do
    timeout -k 15 $half python3 bench/optimizer.py --compile on --untied --polar-gemms $gemms \
        --out "$OUT/optimizer_$gemms.json" > "$L/optimizer_$gemms.log" 2>&1
    echo "exit $? after $(elapsed) s" >> "$L/optimizer_$gemms.log"
    tail -n 12 "$L/optimizer_$gemms.log"
  done
else
  echo "optimizer bench skipped: $(left) s left"
fi
pack_outputs
