"""The fused lm-head + softcapped cross-entropy with an fp8 lm head: the GEMMs of
kernels/softcap_ce.py in fp8 (model/fp8.py's quantisation, layouts and t1s::scaled_mm), the same
Triton kernel between them.

What it replaces: with `lm_head` among Fp8Config.sites the training forward ran
`training_loss(softcap(fp8_matmul(x, lm_head)))`, the torch loss over fp8 logits (the fused
kernel took bf16 GEMMs only), so an fp8 lm head gave up the fused loss (13.3 instead of 3.2 ms
per stage-C micro-step beyond the GEMMs, kernels/softcap_ce.py "Speed") to halve the GEMMs' time.
Here it keeps both, as the public record does (FusedSoftcappedCrossEntropy, facts 1.6-1.7).
Speed: the training step at stage C on one H200 is 0.956x of the bf16 head's (698.1 vs 730.0 ms,
scripts/gpu/fp8_step.sh's fp8_head variant, docs/results/step_variants_h200_2026-12-01_fp8_C.json),
measured before the gradient's quantisation moved into kernels/fp8_quantise.py.

How it works (one definition for eager, torch.compile and CUDA-graph capture; shapes below):
    forward   x8 = q4(x / x_s) [T, D], w8 = q4(w / w_s) [D, V]      (e4m3; graph code, fused)
              t1s::softcap_ce_fp8_fwd: z = _scaled_mm(x8, w8) * x_s * w_s -> bf16 [T, V]
                (fast accumulation), then kernels/softcap_ce.py's kernel: loss [T], the row
                scale r [T] and dz written over z (r[:, None] * dz is dloss/dz for a unit
                upstream gradient; r = 1 but with LaunchConfig.one_pass)
    backward  upstream g [T]: g8 = q5(dz * (g * r)[:, None] / grad_s) [T, V]       (e5m2)
                t1s::fp8_quantise_both_layouts (kernels/fp8_quantise.py): one Triton kernel
                writes g8 row-major and column-major; no float32 [T, V] gz is materialised
                (LaunchConfig.recompute: the forward left the logits z in place, and
                t1s::fp8_logit_grad (kernels/fp8_logit_grad.py) writes g8 of the gradient it
                recomputes from them, the same two layouts)
              dx = _scaled_mm(g8, w8^T) * grad_s * w_s -> bf16 [T, D]
              dw = _scaled_mm(x8^T, g8) * x_s * grad_s -> fp32 [D, V], then w's dtype
The backward is fp8_matmul's: the kernel's g8 is bitwise model/fp8.quantise(dz * (g * r)[:, None],
grad_s, E5M2) in the layouts fp8_matmul_grads makes of it, and the GEMMs are
model/fp8.fp8_grads_from_quantised (x8 column-major, w8 row-major, exact accumulation); so an
fp8 lm head trains on the same gradient as the torch loss would give it, up to the bf16 rounding
of dz (as in the bf16 fused op). Unlike the record's backward, which ignores grad_output, g is
applied exactly; scaling the rows before quantising keeps one g8 for both GEMMs. (Before the
kernel, inductor fused gz, its quantisation and both layouts into one pointwise kernel with one
transposed write: 4.5 ms per stage-C micro-step on one H200; the kernel: 3.43 ms, against 4.38 ms
for the inductor-compiled reference, docs/results/gpu_tests_fp8_h200_2026-12-02.log. Quantising in
the loss kernel's forward instead, as the record does, was measured slower: 18.52 vs 17.67 ms for
the head's forward + backward per stage-C micro-step, docs/LOG.md "eleventh session".)

Scales: the lm head's static ones (Fp8Matmuls.lm_head_{x,w,grad}_scale, facts 1.7: 100/448,
1.6/448, 0.75/448 x the loss's gradient scale 1 / micro-steps, so g8 keeps its range whatever the
micro-step count), passed as their buffers (nothing writes them during a step).

Slow reference: model/fp8.py's fp8_matmul_reference / fp8_matmul_backward_reference around
model/loss.py's training_loss (tests/softcap_ce_cases.py checks the op against it on the CPU in
the Triton interpreter; tests/test_softcap_ce_gpu.py on the H200).

Registration: t1s::softcap_ce_fp8_fwd is a custom op with a fake kernel and
torch.Tag.needs_exact_strides (x8 row-major, w8 column-major: model/fp8.py's layout rules), no
autograd of its own; `_Fp8SoftcapCE` is an autograd.Function that dynamo traces, so the forward's
quantisations are graph code inductor fuses, the gradient's is the t1s::fp8_quantise_both_layouts
extern call and the backward's GEMMs are t1s::scaled_mm calls. T, D and V must be multiples of 16
(torch._scaled_mm).

CPU: both Triton kernels (the loss's and the gradient's quantisation) run on CPU tensors only in
the Triton interpreter (tests/softcap_ce_cases.py); otherwise the forward is already a ValueError
(kernels/softcap_ce.py), so the backward takes the same kernel path on every device. On fake
tensors (tracing on the CPU machine) the ops' fake kernels run.
"""

from __future__ import annotations

import torch
from torch import Tensor

from track_1_short.kernels.fp8_logit_grad import fp8_logit_grad
from track_1_short.kernels.fp8_quantise import quantise_both_layouts
from track_1_short.kernels.softcap_ce import (DEFAULT_LAUNCH, LaunchConfig, _check_inputs, launch_arg,
                                              softcap_ce_rows_)
from track_1_short.model.fp8 import (E5M2, check_fp8_dims, col_major, fp8_grads_from_quantised,
                                     quantise_operands, row_major, scaled_mm_body)


def _fwd_body(x8: Tensor, w8: Tensor, x_s: Tensor, w_s: Tensor, targets: Tensor, mtp_weights: Tensor,
              prefix_weight: Tensor, prefix_targets: Tensor, block_v: int, num_warps: int,
              programs_per_sm: int, fast_math: bool, fma_exp_passes: int,
              tanh_sigmoid: bool = False, one_pass: bool = False,
              recompute: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """(loss float32 [T], dz bf16 [T, V], row scale float32 [T]) from x8 e4m3 [T, D] row-major
    and w8 e4m3 [D, V] column-major (module docstring, forward); dloss/dz = scale[:, None] * dz;
    with recompute the logits z instead of dz (the backward recomputes the gradient)."""
    z = scaled_mm_body(x8, w8, x_s, w_s, torch.bfloat16, True)  # [T, V], overwritten with dz
    launch = LaunchConfig.from_op_args(block_v, num_warps, programs_per_sm, fast_math, fma_exp_passes,
                                       tanh_sigmoid, one_pass, recompute)
    loss, scale = softcap_ce_rows_(z, targets, mtp_weights, prefix_weight, prefix_targets, launch)
    return loss, z, scale


softcap_ce_fp8_fwd = torch.library.custom_op("t1s::softcap_ce_fp8_fwd", _fwd_body, mutates_args=(),
                                             tags=(torch.Tag.needs_exact_strides,))


@softcap_ce_fp8_fwd.register_fake
def _fwd_fake(x8, w8, x_s, w_s, targets, mtp_weights, prefix_weight, prefix_targets, block_v,
              num_warps, programs_per_sm, fast_math, fma_exp_passes, tanh_sigmoid=False, one_pass=False,
              recompute=False):
    t, v = x8.shape[0], w8.shape[1]
    return (x8.new_empty(t, dtype=torch.float32), x8.new_empty((t, v), dtype=torch.bfloat16),
            x8.new_empty(t, dtype=torch.float32))


class _Fp8SoftcapCE(torch.autograd.Function):
    """loss [T] of softcap(x @ w) with the lm head in fp8 (module docstring)."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, x_s: Tensor, w_s: Tensor, grad_s: Tensor, targets: Tensor,
                mtp_weights: Tensor, prefix_weight: Tensor, prefix_targets: Tensor, *launch_args) -> Tensor:
        """launch_args: LaunchConfig.op_args()."""
        x8, w8 = quantise_operands(x, w, x_s, w_s)  # [T, D], [D, V] e4m3
        loss, dz, scale = softcap_ce_fp8_fwd(row_major(x8), col_major(w8), x_s, w_s, targets,
                                             mtp_weights, prefix_weight, prefix_targets, *launch_args)
        ctx.save_for_backward(col_major(x8), row_major(w8), x_s, w_s, grad_s, dz, scale, targets,
                              mtp_weights, prefix_weight, prefix_targets)
        ctx.dtypes = (x.dtype, w.dtype)
        ctx.num_inputs = 9 + len(launch_args)
        ctx.launch_args = launch_args
        return loss

    @staticmethod
    def backward(ctx, g: Tensor):
        x8_col, w8_row, x_s, w_s, grad_s, dz, scale, *slots = ctx.saved_tensors  # ..., [T, V], [T]
        g = g.float()  # [T]
        if launch_arg(ctx.launch_args, "recompute"):  # dz holds the logits: the gradient
            targets, mtp_weights, prefix_weight, prefix_targets = slots  # recomputed as quantised
            g8_row, g8_col = fp8_logit_grad(dz, g * scale, g, targets, prefix_targets, mtp_weights,
                                            prefix_weight, grad_s, ctx.launch_args)
        else:  # the logit gradient dz * (g * scale)[:, None] quantised, [T, V] row- and column-major
            g8_row, g8_col = quantise_both_layouts(dz, grad_s, E5M2, row_mul=g * scale)
        dx, dw = fp8_grads_from_quantised(g8_row, g8_col, grad_s, x8_col, w8_row, x_s, w_s,
                                          ctx.dtypes)
        return dx, dw, *([None] * (ctx.num_inputs - 2))


def linear_softcap_ce_fp8(x: Tensor, w: Tensor, targets: Tensor, mtp_weights: Tensor,
                          prefix_weight: Tensor, prefix_targets: Tensor, *, x_s: Tensor, w_s: Tensor,
                          grad_s: Tensor, launch: LaunchConfig = DEFAULT_LAUNCH) -> Tensor:
    """Per-token training loss float32 [T] of softcap(x @ w) with x and w quantised to e4m3 by the
    dequantisation scales x_s, w_s and the logit gradient to e5m2 by grad_s (float32 0-d device
    tensors in their own storage); differentiable in x and w. The other arguments as
    kernels/softcap_ce.linear_softcap_ce's (x, w bf16 or float32 here: the logit gradient is
    bf16 either way). ValueError for inputs the kernel or torch._scaled_mm cannot take."""
    _check_inputs(x, w, targets, mtp_weights, prefix_weight, prefix_targets)
    check_fp8_dims("linear_softcap_ce_fp8", x, w, "T, D, V",
                   "keep lm_head out of Fp8Config.sites for these shapes")
    return _Fp8SoftcapCE.apply(x, w, x_s, w_s, grad_s, targets, mtp_weights, prefix_weight,
                               prefix_targets, *launch.op_args())
