#!/usr/bin/env bash
# fp8 against bf16 in the trainer's real step at one stage (default C), one H200, one device call
# from the repo root ($OUT: the tool's folder):
#   STAGE=C VARIANTS="bf16 fp8_mlp fp8_all" bash scripts/gpu/fp8_step.sh
#   carry [".carry/tiktoken", "data/embedded-large"]
# Each variant is one process of bench/step.py --stage $STAGE --steps 20 --graphs on, 8
# micro-steps, on data/embedded-large -> $OUT/step_${STAGE}_<variant>.json (per-phase times, top
# kernels, MFU), one after the other (never beside each other: timing):
#   bf16     the default (bf16 GEMMs, the fused lm-head + softcapped CE kernel)
#   fp8_mlp  --set model.fp8.enabled=true --set model.fp8.sites=mlp_up,mlp_down: fp8 MLP, the
#            bf16 lm head keeps the fused loss
#   fp8_all  --set model.fp8.enabled=true: fp8 lm head and MLP (the lm head's GEMMs in fp8 around
#            the fused loss kernel, kernels/softcap_ce_fp8.py)
#   fp8_head --set model.fp8.enabled=true --set model.fp8.sites=lm_head: the fp8 lm head alone
#   fa4_fp8_head  fa4 with the fp8 lm head
#   autotune --set train.max_autotune=true: bf16, inductor's max_autotune (Triton GEMM templates
#            with ReLU^2 and its derivative fused as epilogues where they win; compiles take
#            several times longer: run it alone, VARIANTS=autotune)
#   fa4      --set model.attention_backend=fa4: FlashAttention 4 instead of FlexAttention (bf16
#            otherwise). Needs the package: the call before carries [".carry/fa4a"] and this one
#            [".carry/fa4b", ".carry/tiktoken", "data/embedded"] (scripts/gpu/fa4_wheels.sh); this
#            script then runs fa4_install.sh and the fa4 GPU tests first, e.g.
#            DATA=data/embedded VARIANTS="bf16 fa4 quack_mlp fa4_quack" bash scripts/gpu/fp8_step.sh
#   quack_mlp --set train.mlp_kernel=quack: the MLP's GEMMs from quack-kernels with ReLU^2 and its
#            derivative in their epilogues (kernels/relu2_mlp.py; the same package carry as fa4)
#   fa4_quack both
#   fast     fa4_quack with the fp8 lm head: every kernel change that won at C alone (2026-12-01);
#            from 2026-12-03 its fused loss runs the recompute schedule (train.fused_loss_schedule
#            auto with an fp8 lm head): variants before then ran two passes
#   fast_head_mudd  fast with the loss variant head_mudd's flags (scripts/gpu/loss_variants.sh):
#            the record's architecture, which matched its loss where our default did not; its
#            step time is the one to hold against the record's
#   head_mudd_fp8 the loss variant head_mudd_fo_fp8's flags (the configuration whose loss matched
#            the record's, 2026-12-02: fp8 lm head and MLP forward, bf16 MLP backward)
#   fast_head_mudd_fp8 head_mudd_fp8 with fa4 (the fp8 MLP takes the place of the quack MLP,
#            which fp8 on mlp_down excludes): the candidate to hold against the record
#   fast_fp8up fast with the quack MLP's up projection in fp8 (kernels/relu2_mlp.py
#            quack_relu2_mlp_fp8_up: HEAD's fp8 MLP up with ReLU^2 in quack's epilogue, the down
#            projection and the MLP backward bf16; measured 1.052x of fast, 2026-12-02)
#   fast_head_mudd_fp8up fast_fp8up with head_mudd's flags: the record's architecture with the
#            fp8 lm head, the fp8 up projection and the fused ReLU^2 together
#   fast_1pass fast with the fused loss kernel in one pass over each logit row
#            (--set train.fused_loss_schedule=one_pass; kernels/softcap_ce.py "One pass")
#   fast_head_mudd_1pass fast_head_mudd with it: the like-for-like step against the record
#   fast_recompute fast with the fp8 head's recompute schedule (--set
#            train.fused_loss_schedule=recompute: the forward writes no gradient, the backward
#            recomputes it as it quantises it, kernels/fp8_logit_grad.py)
#   fast_head_mudd_recompute fast_head_mudd with it
#   head_mudd the loss variant head_mudd alone (bf16, FlexAttention): what its flags cost
#   mudd     --set model.mudd.gates=true --set model.mudd.dc=true --set model.mudd.connections=true:
#            what HEAD's MUDD (DC in torch ops here) costs per step, if the loss ablations keep it
#   dense_ngram --set model.ngram.update=dense --set model.ngram.weight_decay=0.025: the n-gram
#            event over every row (HEAD's bigram Adam), for the same reason
# Wall, one H200 (measured 2026-12-01, docs/results/step_variants_h200_2026-12-01/fp8_step.log):
# bf16 at C ~125 s cold, ~85 s with warm caches (compile, capture, self-check, 22 steps of 0.72 s),
# fa4 ~100 s after its package install and GPU tests (~70 s); a variant that compiles new graphs ~150-180 s
# cold, so three need ~500 s; each gets what is left of the call's deadline (DEADLINE_S, 585 s)
# and a cut one still leaves its JSON so far. The summary: bench/step_variants.py ->
# $OUT/step_variants_h200_<date>_<STAGE>.json (every variant against BASELINE, default bf16).
source scripts/gpu/common.sh  # run from the repo root
source scripts/gpu/loss_variants.sh  # loss_variant_flags
DATA=${DATA:-data/embedded-large} STAGE=${STAGE:-C} VARIANTS=${VARIANTS:-bf16 fp8_mlp fp8_all}
variant_flags() {
  case "$1" in
    bf16) ;;
    fp8_mlp) echo --set model.fp8.enabled=true --set model.fp8.sites=mlp_up,mlp_down ;;
    fp8_all) echo --set model.fp8.enabled=true ;;
    fp8_head) echo --set model.fp8.enabled=true --set model.fp8.sites=lm_head ;;
    fa4_fp8_head) echo --set model.attention_backend=fa4 --set model.fp8.enabled=true --set model.fp8.sites=lm_head ;;
    autotune) echo --set train.max_autotune=true ;;
    fa4) echo --set model.attention_backend=fa4 ;;
    quack_mlp) echo --set train.mlp_kernel=quack ;;
    fa4_quack) echo --set model.attention_backend=fa4 --set train.mlp_kernel=quack ;;
    fast) echo "$(variant_flags fa4_quack) $(variant_flags fp8_head)" ;;
    fast_head_mudd) echo "$(variant_flags fast) $(loss_variant_flags head_mudd)" ;;
    fast_fp8up) echo "$(variant_flags fa4_quack) --set model.fp8.enabled=true" \
                     "--set model.fp8.sites=lm_head,mlp_up --set model.fp8.mlp_backward=bf16" ;;
    fast_head_mudd_fp8up) echo "$(variant_flags fast_fp8up) $(loss_variant_flags head_mudd)" ;;
    fast_1pass) echo "$(variant_flags fast) --set train.fused_loss_schedule=one_pass" ;;
    fast_head_mudd_1pass) echo "$(variant_flags fast_head_mudd) --set train.fused_loss_schedule=one_pass" ;;
    fast_recompute) echo "$(variant_flags fast) --set train.fused_loss_schedule=recompute" ;;
    fast_head_mudd_recompute) echo "$(variant_flags fast_head_mudd) --set train.fused_loss_schedule=recompute" ;;
    head_mudd_fp8) loss_variant_flags head_mudd_fo_fp8 ;;
    fast_head_mudd_fp8) echo "$(loss_variant_flags head_mudd_fo_fp8) $(variant_flags fa4)" ;;
    head_mudd) loss_variant_flags head_mudd ;;
    mudd) echo --set model.mudd.gates=true --set model.mudd.dc=true --set model.mudd.connections=true ;;
    dense_ngram) echo --set model.ngram.update=dense --set model.ngram.weight_decay=0.025 ;;
    *) echo "fp8_step.sh: unknown variant '$1'" >&2; return 2 ;;
  esac
}
step_variant() {  # NAME LIMIT_S FLAGS...
  local v=$1 limit=$2
  shift 2
  timeout -k 10 "$limit" python3 bench/step.py --stage "$STAGE" --steps 20 --graphs on --micro-steps 8 \
      --data-dir "$DATA" "$@" --out "$OUT/step_${STAGE}_$v.json" > "$L/step_${STAGE}_$v.log" 2>&1
}
all_flags=""  # every variant's flags: which packages and GPU tests the call needs follows from them
for v in $VARIANTS; do all_flags+=" $(variant_flags "$v")" || exit 2; done
if [[ $all_flags == *attention_backend=fa4* || $all_flags == *mlp_kernel=quack* ]]; then  # the package, then its kernels' GPU tests
  use_fa4_packages
  run_gpu_tests "$L/fa4_quack_gpu_tests.log" 240 tests/test_relu2_mlp_gpu.py tests/test_attention_gpu.py \
      -k "fa4 or quack"
fi
if [[ $all_flags == *fp8.enabled=true* ]]; then  # the fp8 GPU tests first (the head loss, the MLP's bf16 backward)
  run_gpu_tests "$L/softcap_ce_fp8_gpu_tests.log" 180 -s tests/test_softcap_ce_fp8_gpu.py \
      tests/test_fp8_gpu.py::test_mlp_bf16_backward_under_inductor_is_the_plain_backward
fi
run_variants fp8_step 15 90 step_variant variant_flags || exit 2
# one JSON of every variant against BASELINE (default bf16, when it ran in this call)
BASELINE=${BASELINE:-bf16}
python3 bench/step_variants.py "$OUT"/step_"${STAGE}"_*.json --baseline "$BASELINE" --out-dir "$OUT" \
    --script "STAGE=$STAGE VARIANTS='$VARIANTS' DATA=$DATA bash scripts/gpu/fp8_step.sh" 2>&1 | tee -a "$L/fp8_step.log"
pack_outputs
