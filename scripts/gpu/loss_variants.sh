#!/usr/bin/env bash
# The loss variants: `loss_variant_flags NAME` prints one variant's trainer flags (after the common
# ones of the script that runs it); nonzero (2) for an unknown name. One definition, sourced by
# scripts/gpu/loss_ablations.sh (each variant against base), scripts/gpu/loss_parity.sh
# (VARIANT=NAME: ours with those flags against the record in one command) and
# scripts/gpu/fp8_step.sh (the step time of a loss variant); tests/test_gpu_scripts.py parses and
# builds every one on the CPU.
#   base        the defaults (the parity run's configuration)
#   data_seed1  --data-seed 1: another document order (the noise of one curve)
#   init_seed1  --seed 1: another init (the noise of one curve)
#   uniform_o   --set model.attn_out_init=uniform: attention output projections drawn like V (HEAD)
#   dense_ngram --set model.ngram.update=dense: dense Adam on the n-gram table (HEAD's bigram)
#   dense_wd    dense_ngram with --set model.ngram.weight_decay=0.025: HEAD's bigram Adam also
#               decays (cautious, lr^2 x 0.005 x wd_mul 5)
#   no_trigram  --set model.ngram.trigram=false: the bigram table alone (HEAD has no trigrams),
#               with --set model.ngram.trigram_rows=8: the dead trigram rows left out (runs before
#               2026-12-02's twelfth session kept all 377,280 of them: the same arithmetic on every
#               bigram row, but another config.json, so `pool` keeps them apart)
#   attn_in7    --set model.attn_input_layer=7: layers 8-10 attend over norm(h_7) (HEAD)
#   backout7    --set model.backout_layer=7 --set model.backout=-0.5: the final norm reads
#               x - 0.5 h_7 (HEAD's post-loop coefficient at init)
#   head_like   all five HEAD-like changes above at once, the n-gram table's decay too
#   mudd_gates  --set model.mudd.gates=true: per-token x0 / n-gram / skip gates, XSA on 1, 3, 4, 7,
#               output gates on 3 and 10 (HEAD's MUDD gates)
#   mudd_conn   --set model.mudd.connections=true: the last layer and the final norm read
#               per-token amounts of earlier residuals (HEAD's MUDD; the backout is learned)
#   mudd_dc     mudd_gates with --set model.mudd.dc=true: DC on layer 10 (HEAD's lightweight
#               dynamically composable attention; in torch ops here)
#   head_mudd   head_like with MUDD (gates, DC, connections) instead of the constant backout:
#               HEAD's model, the trainer's --model-profile record (config.py's MODEL_PROFILES;
#               tests/test_gpu_scripts.py checks it is the ablations uniform_o, dense_wd,
#               no_trigram, attn_in7, mudd_dc and mudd_conn together)
#   adamw       --optimizer adamw: the AdamW baseline instead of ANVIL + Adam
#   file_order  --set data.shuffle=false: the train documents in file order, as the record reads
#               them: on embedded-large with the small-gpu schedule every micro-batch then holds
#               the record's tokens up to its first repeat (step 107; checked on the CPU by
#               bench/loss_parity.first_stream_difference), so a parity run compares models, not
#               document orders
#   head_mudd_fo head_mudd in file order: the parity run's candidate
#   head_mudd_fo_fp8 head_mudd_fo with --set model.fp8.enabled=true --set
#               model.fp8.mlp_backward=bf16: the lm head in fp8 and the MLP forward in fp8 with
#               its backward in bf16, as the record trains (facts 1.7; its eval is bf16, as
#               ours): the parity run of 2026-12-02 had ours in bf16 against the record in fp8
# `parity_train_cmd DATA VAL_EVERY VAL_TOKENS VAL_SEQ` sets the array PARITY_TRAIN to our trainer's
# command for a loss comparison with the record, before the caller's --max-steps, --run-id and
# variant flags (one definition for loss_parity.sh and loss_ablations.sh, so their runs pool):
# small-gpu with graphs on DATA, validation every VAL_EVERY steps on the record's VAL_TOKENS
# tokens in forwards of VAL_SEQ (our loader wants one token more), at a stage's first step in the
# new stage's windows as the record validates, the train objective every step, runs in $OUT/runs.
parity_train_cmd() {
  PARITY_TRAIN=(python3 -m track_1_short.train --preset small-gpu --data-dir "$1" --graphs on
                --val-every "$2" --val-tokens $(( $3 + 1 )) --val-tokens-per-batch "$4"
                --runs-dir "$OUT/runs" --no-save-final --log-every 1
                --set schedule.stage_start_validation=next)
}
loss_variant_flags() {
  case "$1" in
    base) ;;
    data_seed1) echo --data-seed 1 ;;
    init_seed1) echo --seed 1 ;;
    uniform_o) echo --set model.attn_out_init=uniform ;;
    dense_ngram) echo --set model.ngram.update=dense ;;
    dense_wd) echo --set model.ngram.update=dense --set model.ngram.weight_decay=0.025 ;;
    no_trigram) echo --set model.ngram.trigram=false --set model.ngram.trigram_rows=8 ;;
    attn_in7) echo --set model.attn_input_layer=7 ;;
    backout7) echo --set model.backout_layer=7 --set model.backout=-0.5 ;;
    head_like) echo "$(loss_variant_flags uniform_o) $(loss_variant_flags dense_wd)" \
                    "$(loss_variant_flags no_trigram) $(loss_variant_flags attn_in7)" \
                    "$(loss_variant_flags backout7)" ;;
    mudd_gates) echo --set model.mudd.gates=true ;;
    mudd_conn) echo --set model.mudd.connections=true ;;
    mudd_dc) echo --set model.mudd.gates=true --set model.mudd.dc=true ;;
    head_mudd) echo --model-profile record ;;
    adamw) echo --optimizer adamw ;;
    file_order) echo --set data.shuffle=false ;;
    head_mudd_fo) echo "$(loss_variant_flags head_mudd) $(loss_variant_flags file_order)" ;;
    head_mudd_fo_fp8) echo "$(loss_variant_flags head_mudd_fo) --set model.fp8.enabled=true" \
                           "--set model.fp8.mlp_backward=bf16" ;;
    *) echo "loss_variants.sh: unknown variant '$1'" >&2; return 2 ;;
  esac
}
