"""The fp8 lm head's logit gradient recomputed from the logits and quantised into both GEMM layouts
in one read of the row: the backward of the loss kernel's "Recompute" schedule.

What it replaces: with the one-pass schedule (kernels/softcap_ce.py, "One pass") the fp8 head's
forward writes the gradient u = exp(z' - 23) s (1 - s) over the logits (one read and one write of
the bf16 [T, V] row, 9.9 GB at stage C: 2.53 ms on one H200) and its backward quantises
(g r) u into e5m2, row- and column-major (kernels/fp8_quantise.py: one read, two fp8 writes,
9.9 GB: 3.52 ms; docs/results/loss_kernel_onepass_h200_2026-12-02/). With LaunchConfig.recompute
the forward only reads the logits (4.9 GB: the loss and the row scale r, the logits left in place)
and this kernel reads them once more and writes the two fp8 layouts of the finished gradient
(9.9 GB): 14.8 GB in all instead of 19.8. Predicted at stage C: ~1.3 ms + ~3.6 ms against
2.53 + 3.52 ms, ~-1 ms per micro-step (~-8 ms per step). Measured on one H200 in one call
(tests/test_softcap_ce_fp8_gpu.py, docs/results/gpu_tests_softcap_ce_fp8_recompute_h200_2026-12-03/
call2_after_fix.log): forward 1.73 + this kernel 2.98 ms at C against 2.55 + 3.49 (-1.33 ms per
micro-step), 0.59 + 1.19 against 0.87 + 1.30 at A; the e5m2 gradient's error against the exact
float32 one 0.04596 against the one-pass path's 0.04600, 99.2% of its bytes equal to that path's.
In the training step (fast kernels, stage C): 2.72 ms per micro-step for this kernel, 1.81 for
the forward (docs/results/vs_record_h200_2026-12-03/step_C.json).

How it works (shapes below; g the upstream gradient [T], r = W (23 / 7.5) / S' the forward's row
scale, h = g r, s = sigmoid((z + 5) / 7.5) so z' = 23 s):
    main kernel, one program per [BLOCK_R, BLOCK_C] tile of z (kernels/fp8_quantise.py's tiling):
        v = h * exp(z' - 23) * s (1 - s)             (float32; kernels/softcap_ce.py's sigmoid
                                                        and exp helpers, LaunchConfig's variants)
        q = fp8(v * (1 / grad_s))                      (clamped, rounded to nearest even)
        row[t, j] = q, col[t, j] = q                   (fp8_quantise.store_both_layouts)
    fix-up kernel, one program per row, after it: the row's target slots (softcap_ce.row_slots:
    MTP targets and the prefix, their weights, sub the weights naming each slot's column)
        v = h * exp(z' - 23) * s (1 - s) - g * sub * (23 / 7.5) * s (1 - s)   at each slot's column
        (the one-hot terms: (W p - sub) dz'/dz times g, as the forward's fix-up writes it)
The value is the gradient of the two-pass kernel times g, computed in float32 and rounded once, to
e5m2 (the other schedules round it to bf16 first). The division by grad_s is a multiply by its
float32 reciprocal (one rounding more than model/fp8.quantise's IEEE division: a quotient within
~1 float32 ulp of an e5m2 rounding boundary may round the other way).

Slow reference: model/fp8.quantise of the float64 gradient of model/loss.py's training_loss
(tests/softcap_ce_cases.py: every element equals it but within a float32-rounding distance of an
e5m2 boundary, in the interpreter; tests/test_softcap_ce_fp8_gpu.py on the H200, where
tanh.approx widens that distance).

What must stay stable: nothing is owned across calls; every call allocates its two outputs (graph
pool under CUDA graphs). h, g, grad_s, the targets and the weights are device tensors read by the
kernels (values may change between replays). No host sync, no data-dependent shape; it compiles
per (dtypes, N, launch, Triton's specialisations): call it once per key before capture (the
project's warmup does).

Registration: `t1s::fp8_logit_grad` is a torch.library.custom_op with a fake kernel and no
autograd (it runs inside the fp8 head's backward), one opaque extern call under
torch.compile(fullgraph=True), captured by CUDA graphs.

CPU: the kernels run on CPU tensors only in the Triton interpreter (TRITON_INTERPRET=1 before
triton is imported: tests/softcap_ce_cases.py); otherwise a CPU call is a ValueError.

Legend: T tokens (rows), V vocab (columns), N MTP targets, BLOCK_R x BLOCK_C a tile.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from torch import Tensor

from track_1_short.kernels.fp8_quantise import (EXPONENT_BIAS, MANTISSA_BITS, QuantiseLaunch,
                                                program_tile, store_both_layouts, to_fp8)
from track_1_short.kernels.softcap_ce import (DCAP, LaunchConfig, check_targets, interpreted, launch_arg,
                                              row_slots, sigmoid_of_logit, unnormalised_exp)
from track_1_short.model.fp8 import E5M2, FP8_MAX


@triton.jit
def _unscaled_grad(z, FMA: tl.constexpr, FAST: tl.constexpr, TANH: tl.constexpr):
    """float32 logits z -> (u = exp(z' - 23) s (1 - s), s (1 - s)): the gradient up to the row's
    scale r (kernels/softcap_ce.py "One pass"), and the sigmoid's derivative factor."""
    s = sigmoid_of_logit(z, FAST, TANH)
    ds = s * (1.0 - s)
    return unnormalised_exp(s, FMA, FAST) * ds, ds


@triton.jit
def _logit_grad_tiles(z_ptr, h_ptr, scale_ptr, row_ptr, col_ptr, R, C, FMAX: tl.constexpr,
                      MANT: tl.constexpr, BIAS: tl.constexpr, HW_CAST: tl.constexpr,
                      FMA: tl.constexpr, FAST: tl.constexpr, TANH: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    r, r_ok, mask, r64, c64 = program_tile(R, C, BLOCK_R, BLOCK_C)
    z = tl.load(z_ptr + r64 * C + c64, mask=mask, other=0.0).to(tl.float32)
    u, _ = _unscaled_grad(z, FMA, FAST, TANH)
    h = tl.load(h_ptr + r, mask=r_ok, other=0.0)  # [BLOCK_R]
    inv_s = 1.0 / tl.load(scale_ptr)
    q = to_fp8((h[:, None] * u) * inv_s, row_ptr.dtype.element_ty, FMAX, MANT, BIAS, HW_CAST)
    store_both_layouts(row_ptr, col_ptr, q, r64, c64, R, C, mask)


@triton.jit
def _logit_grad_fixup(z_ptr, h_ptr, g_ptr, targets_ptr, prefix_ptr, mtp_w_ptr, prefix_w_ptr, scale_ptr,
                      row_ptr, col_ptr, T, V, N: tl.constexpr, NS: tl.constexpr, FMAX: tl.constexpr,
                      MANT: tl.constexpr, BIAS: tl.constexpr, HW_CAST: tl.constexpr,
                      FMA: tl.constexpr, FAST: tl.constexpr, TANH: tl.constexpr):
    row = tl.program_id(0)
    slot, pos, _, sub = row_slots(row, T, targets_ptr, prefix_ptr, mtp_w_ptr, tl.load(prefix_w_ptr), N, NS)
    valid = slot <= N
    r64 = row.to(tl.int64)
    p64 = pos.to(tl.int64)
    z = tl.load(z_ptr + r64 * V + p64, mask=valid, other=0.0).to(tl.float32)  # [NS]
    u, ds = _unscaled_grad(z, FMA, FAST, TANH)
    v = tl.load(h_ptr + row) * u - (tl.load(g_ptr + row) * sub) * (DCAP * ds)
    q = to_fp8(v * (1.0 / tl.load(scale_ptr)), row_ptr.dtype.element_ty, FMAX, MANT, BIAS, HW_CAST)
    tl.store(row_ptr + r64 * V + p64, q, mask=valid)
    tl.store(col_ptr + r64 + p64 * T, q, mask=valid)


def _check_inputs(z: Tensor, h: Tensor, g: Tensor, targets: Tensor, prefix_targets: Tensor,
                  mtp_weights: Tensor, prefix_weight: Tensor, scale: Tensor) -> None:
    """ValueError naming the argument for every input the kernels cannot take (runs on fake
    tensors at trace time too)."""
    where = "fp8_logit_grad"
    if z.dim() != 2 or not z.is_contiguous() or z.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"{where}: z needs contiguous bf16 or float32 [T, V], got {z.dtype} "
                         f"{tuple(z.shape)} strides {z.stride()}")
    t = z.shape[0]
    for name, rows in (("h", h), ("g", g)):
        if rows.dtype != torch.float32 or tuple(rows.shape) != (t,):
            raise ValueError(f"{where}: {name} needs float32 [T={t}], got {rows.dtype} {tuple(rows.shape)}")
    check_targets(where, t, targets, prefix_targets, mtp_weights, prefix_weight)
    if scale.dtype != torch.float32 or scale.dim() != 0:
        raise ValueError(f"{where}: scale needs a float32 0-d tensor, got {scale.dtype} {tuple(scale.shape)}")
    devices = {a.device for a in (z, h, g, targets, prefix_targets, mtp_weights, prefix_weight, scale)}
    if len(devices) != 1:
        raise ValueError(f"{where}: all inputs on one device, got {sorted(map(str, devices))}")


@torch.library.custom_op("t1s::fp8_logit_grad", mutates_args=())
def fp8_logit_grad_op(z: Tensor, h: Tensor, g: Tensor, targets: Tensor, prefix_targets: Tensor,
                      mtp_weights: Tensor, prefix_weight: Tensor, scale: Tensor, fma: bool, fast_math: bool,
                      tanh_sigmoid: bool, block_r: int, block_c: int, num_warps: int,
                      hw_cast: bool) -> tuple[Tensor, Tensor]:
    """(row [T, V] strides (V, 1), col [T, V] strides (1, T)), both e5m2: the logit gradient of
    the logits z for the row factors h = g r and the upstream gradient g, divided by the
    dequantisation scale (module docstring)."""
    _check_inputs(z, h, g, targets, prefix_targets, mtp_weights, prefix_weight, scale)
    cuda = z.device.type == "cuda"
    if not cuda and not interpreted():
        raise ValueError("fp8_logit_grad: CPU tensors run only in the Triton interpreter: set "
                         "TRITON_INTERPRET=1 before triton is imported (tests/softcap_ce_cases.py)")
    (t, v), n = z.shape, mtp_weights.shape[0]
    # the kernels index h and g by row: an upstream gradient of loss.sum() is an expanded (stride
    # 0) tensor, read past its one element otherwise
    h, g = h.contiguous(), g.contiguous()
    row = torch.empty((t, v), dtype=E5M2, device=z.device)  # [T, V] strides (V, 1)
    col = torch.empty_strided((t, v), (1, t), dtype=E5M2, device=z.device)  # [T, V] strides (1, T)
    fp8 = dict(FMAX=FP8_MAX[E5M2], MANT=MANTISSA_BITS[E5M2], BIAS=EXPONENT_BIAS[E5M2],
               HW_CAST=hw_cast and cuda, FMA=fma, FAST=fast_math and cuda, TANH=tanh_sigmoid)
    with torch.cuda.device(z.device) if cuda else contextlib.nullcontext():
        _logit_grad_tiles[(triton.cdiv(t, block_r) * triton.cdiv(v, block_c),)](
            z, h, scale, row, col, t, v, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=num_warps, **fp8)
        _logit_grad_fixup[(t,)](z, h, g, targets.contiguous(), prefix_targets.contiguous(),
                                mtp_weights.contiguous(), prefix_weight, scale, row, col, t, v, N=n,
                                NS=triton.next_power_of_2(n + 1), num_warps=1, **fp8)
    return row, col


@fp8_logit_grad_op.register_fake
def _fp8_logit_grad_fake(z, h, g, targets, prefix_targets, mtp_weights, prefix_weight, scale, fma,
                         fast_math, tanh_sigmoid, block_r, block_c, num_warps, hw_cast):
    _check_inputs(z, h, g, targets, prefix_targets, mtp_weights, prefix_weight, scale)
    (t, v) = z.shape
    return (torch.empty((t, v), dtype=E5M2, device=z.device),
            torch.empty_strided((t, v), (1, t), dtype=E5M2, device=z.device))


def fp8_logit_grad(z: Tensor, h: Tensor, g: Tensor, targets: Tensor, prefix_targets: Tensor,
                   mtp_weights: Tensor, prefix_weight: Tensor, scale: Tensor,
                   launch: LaunchConfig | tuple, tiles: QuantiseLaunch | None = None
                   ) -> tuple[Tensor, Tensor]:
    """(row, col): the e5m2 logit gradient of the logits z [T, V] (contiguous; the forward's GEMM
    output, left in place by LaunchConfig.recompute) for h = g * r [T] (r the forward's row
    scale) and the upstream gradient g [T], divided by `scale` (float32 0-d device tensor), as
    row [T, V] strides (V, 1) and col [T, V] strides (1, T). The targets and weights are the
    forward's (kernels/softcap_ce.linear_softcap_ce's arguments); the sigmoid and exp variants
    are launch's (a LaunchConfig or its op_args(); its pass-1 exp: fma_exp_passes == 2 on the FMA
    pipes); the tiles are kernels/fp8_quantise's. Not differentiable; ValueError for inputs it
    cannot take."""
    tiles = tiles or QuantiseLaunch()
    args = launch.op_args() if isinstance(launch, LaunchConfig) else launch
    return fp8_logit_grad_op(z, h, g, targets, prefix_targets, mtp_weights, prefix_weight, scale,
                             launch_arg(args, "fma_exp_passes") >= 2, launch_arg(args, "fast_math"),
                             launch_arg(args, "tanh_sigmoid"), tiles.block_r, tiles.block_c,
                             tiles.num_warps, tiles.hw_cast)
