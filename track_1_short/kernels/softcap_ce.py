"""Fused lm-head + softcapped cross-entropy (MTP and prefix terms): one Triton kernel that writes
the per-token loss and the logit gradient in the forward, so the backward is two GEMMs.

What it replaces: the training path of GPT.forward, `training_loss(softcap(x @ lm_head), targets,
mtp_weights, prefix_weight, prefix_table[targets])` (model/loss.py, the slow reference, which
tests/test_softcap_ce.py and tests/test_softcap_ce_gpu.py check this against). Why faster: the
torch path runs ~16.5 ms per stage-C micro-step (T=49,152) outside the GEMMs, because its
backward builds two dense float32 [T, V] tensors; the public record (modded-nanogpt HEAD,
FusedSoftcappedCrossEntropy, triton_kernels.py:906-1292; facts 1.6) does the loss in ~3.2 ms
with one kernel that writes the logit gradient in the forward. Floor: one read and one write of
the bf16 logits (4.9 GB at stage C) ~ 2.3 ms at ~4.3 TB/s. Measured below ("Speed").

How it works (one definition for eager, torch.compile and CUDA-graph capture):
    forward   z = x @ w                                    bf16 GEMM (torch.mm) -> [T, V]
              kernel, one program per row (persistent: rows pid, pid + P, ...):
                read the row's N + 1 target slots (targets[t + k], prefix_t): columns, weights,
                  logits
                pass 1 over V in BLOCK_V chunks: S_t = sum_j exp(z'_tj)  -> lse_t, loss_t
                pass 2 over V: W_t softmax_j dz'/dz, written IN PLACE over z (z.dtype)
                fix-up: the slots' columns rewritten with their one-hot terms subtracted
              returns (loss [T] float32, dz [T, V], r [T] float32); dloss/dz = r[:, None] * dz
              (r = 1 here; LaunchConfig.one_pass writes dz up to a row scale, "One pass" below);
              dz and r are saved for the backward
    backward  upstream g [T]: row scaling commutes with the GEMMs, so with h = g * r
              dx = h[:, None] * (dz @ w^T)    dw = (h[:, None] * x)^T @ dz
              (two GEMMs and [T, D] scalings, no [T, V] elementwise pass)
No max pass: z' lies in (0, 23), so exp(z') <= e^23 ~ 1e10 and the float32 sum over V = 50,304
stays below 5e14. The one-hot terms touch N + 1 columns per row, so they are a scalar fix-up
after pass 2 (behind a CTA barrier), not a compare per element.

Speed (bench/loss_kernel.py, one H200, docs/results/loss_kernel_h200.json): per micro-step,
forward + backward of the loss including its three GEMMs, compiled:
    key C (T = 49,152, N = 1):  torch path 31.8 ms, fused 21.6 ms; GEMMs alone 18.4 ms
    key A (T = 16,384, N = 3):  torch path 10.5 ms, fused 7.1 ms;  GEMMs alone 5.7 ms
The kernel alone (before "Sigmoid as tanh" below): 4.2 ms at C, 1.4 ms at A; the loss beyond its GEMMs went from 13.3 to 3.2 ms
at C and 4.8 to 1.4 ms at A, and the peak memory above the inputs from 23.0 to 4.8 GiB at C (dz
is the only [T, V] tensor). Errors against a float32 reference equal the torch path's (dx, dw
relative 2.3e-3, from the bf16 GEMM outputs). The kernel is bound by the MUFU (special function) unit, not by
memory: per element sigmoid needs ex2 + rcp and softmax one ex2, in each pass, 6 MUFU ops at 16
per SM-cycle ~ 3.5 ms at C; ncu (all exps on the MUFU) read SM busy 84%, DRAM 60% of peak,
4.3 ms. Hence fma_exp_passes=1: pass 2's softmax exp2 runs as a degree-5 polynomial on the FMA
pipes (4.3 -> 4.2 ms; both passes: 5.0 ms, then instruction issue binds). The record keeps a
row's sigmoids in shared memory and so skips pass 2's sigmoid; Triton cannot hold a 50,304-wide
row on chip across two loops, and stored to global memory in bf16 they would lose too much
precision (23 * 2^-9 in z').

Fast math (CUDA, LaunchConfig.fast_math): ex2.approx.ftz and rcp.approx.ftz as inline PTX
instead of Triton's exp2 / division (denormal handling and a division sequence): no result
here is denormal (z' >= 0, exp(z' - lse) >= e^-35), so only rounding differs (2 ulp).
Measured 4.5 -> 4.2 ms at C. The interpreter cannot run inline PTX, so the CPU runs the plain
expressions; tests/test_softcap_ce_gpu.py checks both variants on the GPU.

Sigmoid as tanh (LaunchConfig.tanh_sigmoid, the default; CUDA, with fast_math): s = 1/2 +
tanh(y) / 2, y = (z + 5) / 15, as one MUFU tanh.approx.f32 instead of ex2 + rcp, as the record
computes its sigmoid (__tanhf under --use_fast_math). MUFU ops per element: 3 instead of 5 (pass
1: tanh, ex2; pass 2: tanh, the exp on the FMA pipes). Error: tanh.approx is about 2^-11 relative
(PTX ISA), so |error of s| <= 2^-12 and |error of z'| <= 23 * 2^-12 = 0.0056; the record stores
s in bf16 in shared memory (up to 23 * 2^-9 = 0.045 in z'). Propagated to each logit gradient and
loss, the bound tests/test_softcap_ce_gpu.py asserts; measured at key A: worst element 0.71 of
that bound, loss max abs 9.2e-5 (mean -3.5e-6; the bound 2.3e-2), dx / dw relative 2.32e-3 as
the torch path's (docs/results/gpu_tests_softcap_ce_tanh_h200_2026-12-02.log,
loss_kernel_tanh_h200_2026-12-02.json). Speed, the kernel alone on one H200, one call
(docs/results/loss_kernel_tanh_h200_2026-12-02/tanh_sweep2.log, medians of 25): key C 4.33 ms
(exp, 4096 / 8 / 8) -> 3.82 ms (tanh, 2048 / 4 / 8); key A 1.45 -> 1.40 ms. Predicted ~2.6-3.0 ms
at C from the MUFU count alone; what binds now is memory: pass 2 reads the row again, and with
~1,000 rows in flight (100 KB each) that read misses the 50 MB L2, so ~14.8 GB move per call at C
(3.8 ms is ~3.9 TB/s). Fewer rows in flight (2 or 4 per SM) did not keep it in L2 (slower). The
record reads the row once (its sigmoids stay in shared memory).

One pass (LaunchConfig.one_pass; TrainConfig.fused_loss_schedule "one_pass"): the row's scale is the only thing pass 2 needs from pass 1, and a
row scale commutes with the backward's GEMMs like the upstream gradient does. So one pass
writes u_j = exp(z'_j - 23) s_j (1 - s_j) over each chunk as it reads it (z' - 23 lies in
(-23, 0]: no overflow, no denormal, bf16 keeps the same relative precision as the whole
gradient) while it sums S' = sum_j exp(z'_j - 23); then r = W (23 / 7.5) / S', lse = 23 + log S',
and the fix-up writes the slots' columns as (exp(z'_t - 23) - (sub / W) S') s (1 - s), so that
r u is the gradient above (W = 0: r = 0, the row's gradient is 0). The backward multiplies g by
r (above), the fp8 head's quantise kernel takes g r as its row factor. Bytes per element: one
read and one write of the row (4 at bf16, 9.9 GB per call at C) instead of ~6 when pass 2's
re-read misses L2; MUFU ops 2 (tanh, ex2). Predicted at C: ~2.5-2.8 ms against 3.8 (memory at
~3.9 TB/s), at A ~1.0 against 1.4; i.e. ~-1.1 ms per stage-C micro-step, ~-9 ms per step.
Numerics: u rounds to bf16 like dz did (half an ulp relative), r stays float32; the row scale
reaches dw through (h x) rounded to bf16, as g alone did. Measured, the kernel alone on one H200
(docs/results/loss_kernel_onepass_h200_2026-12-02/sweep.log): 2.53 ms at C and 0.85 at A with
4096 / 8 / 8 (ONE_PASS_LAUNCH), against 3.77 / 1.27 for the two-pass default, in one call.

Recompute (LaunchConfig.recompute, with one_pass; the fp8 head's schedule, the default with an
fp8 lm head): the forward runs the one-pass kernel without its stores (loss and row scale only;
the logits stay in place: one read of the row, 4.9 GB at C), and the backward's
kernels/fp8_logit_grad.py recomputes the gradient from the logits as it quantises it into both
e5m2 layouts (one read, two fp8 writes), where the one-pass schedule wrote u in bf16 and the
quantise kernel read it back. The bf16 head cannot use it (its backward GEMMs take the bf16
gradient; refused with a ValueError). Measured on one H200, kernels alone in one call
(tests/test_softcap_ce_fp8_gpu.py, docs/results/gpu_tests_softcap_ce_fp8_recompute_h200_2026-12-03/):
forward 1.73 + backward 2.98 ms at C against one pass's 2.55 + quantise 3.49 (-1.33 ms per
micro-step), 0.59 + 1.19 against 0.87 + 1.30 at A; the fp8 head's forward + backward with its
GEMMs 14.56 against 16.14 (one pass) and 17.50 ms (two passes) at C. Predicted ~1.3 + ~3.6: the
forward is bound by its two MUFU ops per element, the backward faster than the quantise kernel it
replaces (a multiply by the reciprocal scale instead of an IEEE division). Those times are at the
one-pass launch (4096 / 8 / 8); its own sweep (bench/loss_kernel.py --sweep-only, another call)
made 2048 / 4 / 16 its launch (RECOMPUTE_LAUNCH): 1.435 against 1.538 ms at C, 0.479 against 0.521
at A for the forward alone.

Math (equal to model/loss.py up to float32 rounding; N = len(mtp_weights), shapes below):
    z'_tj = 23 * sigmoid((z_tj + 5) / 7.5)        lse_t = log sum_j exp(z'_tj)
    w_tk  = mtp_weights[k] * [t + k < T]          w_tp = prefix_weight * [prefix_t >= 0]
    W_t   = sum_k w_tk + w_tp
    loss_t = sum_k w_tk (lse_t - z'_t[targets[t + k]]) + w_tp (lse_t - z'_t[prefix_t])
           = W_t lse_t - (sum_k w_tk z'_t[targets[t + k]] + w_tp z'_t[prefix_t])   (as computed)
    dloss_t/dz_tj = (W_t softmax(z'_t)_j - sum_k w_tk [j = targets[t + k]] - w_tp [j = prefix_t])
                    * z'_tj (23 - z'_tj) / (23 * 7.5)
The gradient is rounded to z's dtype (bf16 in training: at most 2^-8 relative per element, half
an ulp; measured 1.6e-3 relative overall on the GPU), as the record rounds it (to fp8 e5m2). Unlike the record's backward, which ignores grad_output,
this one applies the upstream gradient exactly, so the loss is an ordinary differentiable tensor.

What must stay stable: nothing here owns memory across calls (every call allocates z/dz and the
loss; under CUDA graphs they live in the graph pool). mtp_weights and prefix_weight are device
tensors read by the kernel (values may change between replays; never read on the host); N is a
shape. No host sync, no data-dependent shapes. The Triton kernel compiles at its first call per
(dtype, N, T, V, launch config) (V and the rows per program are constexprs: the interpreter
needs constant loop bounds): call it once per key before capture (the project's warmup does).

Registration: `t1s::linear_softcap_ce` is a torch.library.custom_op with a fake (meta) kernel and
an autograd formula, so torch.compile(fullgraph=True) keeps it as one opaque extern call and
AOTAutograd traces the backward's GEMMs. Output dz of the raw op is not differentiable.

Plugging in (the lead installs it from outside the model, as a loss strategy): in GPT.forward's
full-softmax training branch (bf16 head; an fp8 lm head takes kernels/softcap_ce_fp8.py, the same
kernel between fp8 GEMMs),
    loss = linear_softcap_ce(x, self.lm_head, targets, cfg.mtp_weights, cfg.prefix_weight,
                             self.prefix_table[targets])           # [T] float32
replaces `training_loss(softcap(x @ lm_head), ...)`; the trainer's loss.sum().backward() is
unchanged.

CPU: the kernel runs on CPU tensors only in the Triton interpreter, i.e. when TRITON_INTERPRET=1
was set before triton was first imported (triton decides at decoration time, also for its own
library functions); tests/softcap_ce_cases.py and bench/loss_kernel.py --smoke run that way in
their own processes. Otherwise a CPU call is a ValueError.

Deviations from the record: bf16 GEMMs and a bf16 logit gradient (the record: fp8 e4m3 GEMM,
e5m2 gradient; kernels/softcap_ce_fp8.py is ours in fp8); a persistent Triton kernel over V
chunks that recomputes the sigmoids (float32, tanh.approx) in its second pass instead of an
NVRTC kernel holding them in shared memory in bf16 (3.8 vs ~3.2 ms at C); the upstream gradient
is honoured.

Legend: T tokens, D model dim, V vocab (padded), N MTP targets, P programs of the kernel.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from track_1_short.model.loss import SOFTCAP_DIV, SOFTCAP_SCALE, SOFTCAP_SHIFT

_LOG2E = 1.0 / math.log(2.0)
# z' = 23 sigmoid((z + 5) / 7.5) = 23 s with s = 1 / (1 + 2^(z * _ARG_MUL + _ARG_ADD));
# exp(z') = 2^(s * _EXP_MUL)
_ARG_MUL = tl.constexpr(-_LOG2E / SOFTCAP_DIV)
_ARG_ADD = tl.constexpr(-SOFTCAP_SHIFT * _LOG2E / SOFTCAP_DIV)
_SCALE = tl.constexpr(SOFTCAP_SCALE)
_EXP_MUL = tl.constexpr(SOFTCAP_SCALE * _LOG2E)
_LOG2E_C = tl.constexpr(_LOG2E)
DCAP = tl.constexpr(SOFTCAP_SCALE / SOFTCAP_DIV)  # dz'/dz = (23 / 7.5) s (1 - s)
# the same s as 1/2 + tanh(y) / 2 with y = (z + 5) / 7.5 / 2 = z * _TANH_MUL + _TANH_ADD
_TANH_MUL = tl.constexpr(0.5 / SOFTCAP_DIV)
_TANH_ADD = tl.constexpr(0.5 * SOFTCAP_SHIFT / SOFTCAP_DIV)

DTYPES = (torch.bfloat16, torch.float32)


@dataclass(slots=True, frozen=True, kw_only=True)
class LaunchConfig:
    """Launch shape and math variant of the kernel. Defaults: the fastest at both keys of the
    tanh sweep on the H200 at V = 50,304 (module docstring, "Sigmoid as tanh"); without
    tanh_sigmoid, 4096 / 8 warps / 8 per SM was within 1% of the fastest ("Speed")."""

    block_v: int = 2048  # columns per chunk (power of two); 16 bf16 per thread at 4 warps
    num_warps: int = 4
    programs_per_sm: int = 8  # P = min(T, SMs * programs_per_sm); on the CPU SMs counts as 1
    fast_math: bool = True  # CUDA: ex2/rcp.approx.ftz inline PTX (module docstring, "Fast math")
    fma_exp_passes: int = 1  # softmax exps on the FMA pipes: 0 none, 1 pass 2, 2 both passes
    tanh_sigmoid: bool = True  # CUDA: the softcap's sigmoid as one tanh.approx ("Sigmoid as tanh")
    # one pass over the row: the gradient written up to a per-row scale (module docstring, "One
    # pass"); its exp on the FMA pipes with fma_exp_passes=2
    one_pass: bool = False
    # with one_pass: the forward writes no gradient, only the loss and the row scale, and leaves
    # the logits in place; the fp8 head's backward recomputes the gradient from them as it
    # quantises it (kernels/fp8_logit_grad.py; module docstring, "Recompute"). fp8 head only:
    # the bf16 op refuses it (its backward GEMMs need the bf16 gradient)
    recompute: bool = False

    def __post_init__(self):
        if self.block_v < 16 or self.block_v & (self.block_v - 1):
            raise ValueError(f"LaunchConfig.block_v={self.block_v}: needs a power of two >= 16")
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"LaunchConfig.num_warps={self.num_warps}: choose 1, 2, 4, 8, 16 or 32")
        if self.programs_per_sm < 1:
            raise ValueError(f"LaunchConfig.programs_per_sm={self.programs_per_sm}: needs >= 1")
        if self.fma_exp_passes not in (0, 1, 2):
            raise ValueError(f"LaunchConfig.fma_exp_passes={self.fma_exp_passes}: choose 0, 1 or 2")
        if self.recompute and not self.one_pass:
            raise ValueError("LaunchConfig.recompute=True needs one_pass=True: the backward "
                             "recomputes the gradient from one pass's row scale")
        if self.tanh_sigmoid and not self.fast_math:
            raise ValueError("LaunchConfig.tanh_sigmoid=True needs fast_math=True: tanh.approx is an "
                             "approximate instruction (module docstring, \"Sigmoid as tanh\")")

    def op_args(self) -> tuple:
        """The fields in the order the custom ops take them (torch.library ops take no dataclass)."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    @classmethod
    def from_op_args(cls, *args) -> "LaunchConfig":
        """The inverse of op_args."""
        return cls(**{f.name: a for f, a in zip(dataclasses.fields(cls), args, strict=True)})


LAUNCH_FIELDS = tuple(f.name for f in dataclasses.fields(LaunchConfig))  # op_args' order, by name


def launch_arg(op_args: tuple, name: str):
    """One field of LaunchConfig.op_args() by name (traceable: no dataclass is built, as dynamo
    tracing an autograd.Function's forward cannot build one)."""
    return op_args[LAUNCH_FIELDS.index(name)]


DEFAULT_LAUNCH = LaunchConfig()
# The one-pass schedule's launch: the fastest of its sweep at both keys on the H200 (4096 / 8 / 8:
# 2.53 ms at C, 0.85 at A, against 2.75 / 0.86 at the two-pass default's 2048 / 4 / 8;
# docs/results/loss_kernel_onepass_h200_2026-12-02/sweep.log)
ONE_PASS_LAUNCH = LaunchConfig(block_v=4096, num_warps=8, programs_per_sm=8, one_pass=True)
# Recompute: one pass's kernel without its stores, at the fastest launch of its sweep at both keys
# on the H200 (2048 / 4 / 16: 1.435 ms at C, 0.479 at A, against 1.538 / 0.521 at the one-pass
# launch 4096 / 8 / 8; bench/loss_kernel.py --sweep-only --sweep-tanh-only,
# docs/results/ngram_vector_atomic_h200_2026-12-03/call4/loss_kernel_sweep.json). Only the forward
# reads block_v, num_warps and programs_per_sm: the backward (kernels/fp8_logit_grad.py) has its
# own tiles.
RECOMPUTE_LAUNCH = LaunchConfig(block_v=2048, num_warps=4, programs_per_sm=16, one_pass=True,
                                recompute=True)
SCHEDULE_LAUNCHES = {"two_pass": DEFAULT_LAUNCH, "one_pass": ONE_PASS_LAUNCH, "recompute": RECOMPUTE_LAUNCH}


def default_launch(schedule: str) -> LaunchConfig:
    """The launch of each schedule (TrainConfig.fused_loss_schedule picks one)."""
    if schedule not in SCHEDULE_LAUNCHES:
        raise ValueError(f"fused loss schedule {schedule!r}: one of {tuple(SCHEDULE_LAUNCHES)}")
    return SCHEDULE_LAUNCHES[schedule]


@triton.jit
def _exp2(x, FAST: tl.constexpr):
    if FAST:  # one MUFU op: the outputs here are never denormal (module docstring, "Fast math")
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.exp2(x)


# 2^f on [-1/2, 1/2], degree-5 minimax (Remez, relative error 7.7e-8; 2.3e-7 evaluated in float32,
# about MUFU ex2.approx's 2 ulp)
_P0 = tl.constexpr(1.0000001192092896)
_P1 = tl.constexpr(0.6931469440460205)
_P2 = tl.constexpr(0.24022114276885986)
_P3 = tl.constexpr(0.05550709739327431)
_P4 = tl.constexpr(0.009675757959485054)
_P5 = tl.constexpr(0.0013277939287945628)
_ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: x + it holds rint(x) in its low mantissa bits


@triton.jit
def _exp2_fma(x):
    """2^x without the MUFU unit (FMA and integer pipes only), for x <= 127; x below -125 gives
    2^-125 (~2e-38, only ever a softmax weight that rounds to 0). x = j + f, j = rint(x): 2^f by
    the polynomial, 2^j added into the exponent bits. (FlashAttention-4 emulates exp2 the same
    way to unload the MUFU unit.)"""
    x = tl.maximum(x, -125.0)
    t = x + _ROUND_MAGIC
    f = x - (t - _ROUND_MAGIC)
    p = ((((_P5 * f + _P4) * f + _P3) * f + _P2) * f + _P1) * f + _P0
    bits = p.to(tl.int32, bitcast=True) + (t.to(tl.int32, bitcast=True) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _softmax_exp2(x, FMA: tl.constexpr, FAST: tl.constexpr):
    """exp2 of pass 1 or 2: on the FMA pipes (FMA) or the MUFU unit."""
    if FMA:
        return _exp2_fma(x)
    else:
        return _exp2(x, FAST)


@triton.jit
def sigmoid_of_logit(z, FAST: tl.constexpr, TANH: tl.constexpr):
    """float32 z -> s = sigmoid((z + 5) / 7.5), so z' = 23 s and exp(z') = 2^(s * _EXP_MUL).
    TANH: s = 1/2 + tanh(y) / 2, one MUFU tanh.approx with FAST (|error of s| <= 2^-12, module
    docstring), else the same identity in exact math (the interpreter's path: it checks the
    constants); otherwise 1 / (1 + 2^(...)), a MUFU ex2 and rcp with FAST."""
    if TANH:
        y = z * _TANH_MUL + _TANH_ADD
        if FAST:
            t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [y], dtype=tl.float32,
                                          is_pure=True, pack=1)
        else:
            t = 2.0 / (1.0 + tl.exp2(y * (-2.0 * _LOG2E_C))) - 1.0
        return 0.5 + 0.5 * t
    d = 1.0 + _exp2(z * _ARG_MUL + _ARG_ADD, FAST)
    if FAST:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [d], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return 1.0 / d


@triton.jit
def _chunk_sigmoid(row_ptr, c, V: tl.constexpr, MASKED: tl.constexpr, FAST: tl.constexpr,
                   TANH: tl.constexpr):
    """s of the logits row_ptr[c] (c [BLOCK_V] columns; MASKED: the tail chunk, c may reach V)."""
    if MASKED:
        z = tl.load(row_ptr + c, mask=c < V, other=0.0)
    else:
        z = tl.load(row_ptr + c)
    return sigmoid_of_logit(z.to(tl.float32), FAST, TANH)


@triton.jit
def _store_chunk_grad(row_ptr, c, grad_scale, lse2, V: tl.constexpr, MASKED: tl.constexpr,
                      FMA: tl.constexpr, FAST: tl.constexpr, TANH: tl.constexpr):
    """row_ptr[c] = W p (dz'/dz) with p = softmax(z')_c, grad_scale = W * 23 / 7.5: the gradient
    of every column but the targets (the fix-up after pass 2 writes those)."""
    s = _chunk_sigmoid(row_ptr, c, V, MASKED, FAST, TANH)
    dz = (grad_scale * _softmax_exp2(s * _EXP_MUL - lse2, FMA, FAST)) * (s * (1.0 - s))
    if MASKED:
        tl.store(row_ptr + c, dz.to(row_ptr.dtype.element_ty), mask=c < V)
    else:
        tl.store(row_ptr + c, dz.to(row_ptr.dtype.element_ty))


@triton.jit
def _store_chunk_unnormalised(row_ptr, c, V: tl.constexpr, MASKED: tl.constexpr, FMA: tl.constexpr,
                              FAST: tl.constexpr, TANH: tl.constexpr, STORE: tl.constexpr):
    """One pass's chunk: e = exp(z' - 23) of the logits row_ptr[c], row_ptr[c] = e s (1 - s) in
    place (the gradient up to the row's scale W (23 / 7.5) / sum_j e_j; not with STORE False,
    "Recompute"); returns e (0 past V)."""
    s = _chunk_sigmoid(row_ptr, c, V, MASKED, FAST, TANH)
    e = unnormalised_exp(s, FMA, FAST)
    if STORE:
        u = e * (s * (1.0 - s))
        if MASKED:
            tl.store(row_ptr + c, u.to(row_ptr.dtype.element_ty), mask=c < V)
        else:
            tl.store(row_ptr + c, u.to(row_ptr.dtype.element_ty))
    if MASKED:
        return tl.where(c < V, e, 0.0)
    else:
        return e


@triton.jit
def unnormalised_exp(s, FMA: tl.constexpr, FAST: tl.constexpr):
    """e = exp(z' - 23) of s = z' / 23 (z' - 23 = 23 (s - 1) lies in (-23, 0]): one pass's
    softmax numerator, the row sum S' = sum_j e_j its denominator."""
    return _softmax_exp2(s * _EXP_MUL - _EXP_MUL, FMA, FAST)


@triton.jit
def row_slots(row, T, targets_ptr, prefix_ptr, mtp_w_ptr, pw, N: tl.constexpr, NS: tl.constexpr):
    """The target slots of one row: (slot [NS] (k < N the MTP targets, N the prefix, beyond N
    padding), pos [NS] their columns in [0, V), w [NS] their weights (0 for a target past T, a
    -1 prefix and the padding), sub [NS] the weights of all slots naming each slot's column
    (duplicates add up)). pw: prefix_weight's value."""
    slot = tl.arange(0, NS)
    mtp_ok = (slot < N) & (row + slot < T)
    tgt = tl.load(targets_ptr + row + slot, mask=mtp_ok, other=0)
    pfx = tl.load(prefix_ptr + row)
    pos = tl.where(slot == N, tl.maximum(pfx, 0), tgt)  # [NS] columns in [0, V)
    w_mtp = tl.load(mtp_w_ptr + slot, mask=mtp_ok, other=0.0)
    w = tl.where(mtp_ok, w_mtp, tl.where((slot == N) & (pfx >= 0), pw, 0.0))  # [NS]
    sub = tl.sum(tl.where(pos[:, None] == pos[None, :], w[None, :], 0.0), axis=1)  # [NS]
    return slot, pos, w, sub


@triton.jit
def _softcap_ce_rows(z_ptr, targets_ptr, prefix_ptr, mtp_w_ptr, prefix_w_ptr, loss_ptr, scale_ptr, T,
                     V: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr, N: tl.constexpr,
                     NS: tl.constexpr, BLOCK_V: tl.constexpr, FMA1: tl.constexpr,
                     FMA2: tl.constexpr, FAST: tl.constexpr, TANH: tl.constexpr,
                     ONE_PASS: tl.constexpr, STORE: tl.constexpr):
    cols = tl.arange(0, BLOCK_V)
    V_FULL: tl.constexpr = V - V % BLOCK_V  # columns in unmasked chunks
    pw = tl.load(prefix_w_ptr)
    # rows pid, pid + P, ...; loop bounds are constexprs: the interpreter turns int arguments into
    # 1-element arrays, which `range` cannot take under numpy >= 2.4
    for i in range(0, ROWS_PER_PROGRAM):
        row = tl.program_id(0) + i * tl.num_programs(0)
        if row < T:
            row_ptr = z_ptr + row.to(tl.int64) * V
            # the slots' columns, weights and logits, read before any store overwrites the row
            slot, pos, w, sub = row_slots(row, T, targets_ptr, prefix_ptr, mtp_w_ptr, pw, N, NS)
            s_slot = sigmoid_of_logit(tl.load(row_ptr + pos).to(tl.float32), FAST, TANH)  # [NS]
            w_total = tl.sum(w, axis=0)
            w_picked = tl.sum(w * (_SCALE * s_slot), axis=0)
            if ONE_PASS:
                # every warp has read the slots' logits before any warp overwrites the row
                if STORE:
                    tl.debug_barrier()
                # the one pass: S' = sum_j exp(z'_j - 23), e s (1 - s) written in place (STORE)
                acc = tl.zeros([BLOCK_V], dtype=tl.float32)
                for start in range(0, V_FULL, BLOCK_V):
                    acc += _store_chunk_unnormalised(row_ptr, start + cols, V, False, FMA1, FAST, TANH,
                                                     STORE)
                if V_FULL < V:
                    acc += _store_chunk_unnormalised(row_ptr, V_FULL + cols, V, True, FMA1, FAST, TANH,
                                                     STORE)
                total = tl.sum(acc, axis=0)
                lse = _SCALE + tl.log(total)
                scale = tl.where(w_total > 0.0, w_total * DCAP / total, 0.0)
                # fix-up of the target columns, after every warp's stores: (e - (sub / W) S') s (1 - s),
                # which the row's scale turns into (W p - sub) dz'/dz
                if STORE:
                    tl.debug_barrier()
                ratio = sub / tl.where(w_total > 0.0, w_total, 1.0)  # W = 0: sub = 0
                e_slot = unnormalised_exp(s_slot, FMA1, FAST)
                dz_slot = (e_slot - ratio * total) * (s_slot * (1.0 - s_slot))
            else:
                # pass 1: S = sum_j exp(z'_j) (z' < 23: no max needed)
                acc = tl.zeros([BLOCK_V], dtype=tl.float32)
                for start in range(0, V_FULL, BLOCK_V):
                    s = _chunk_sigmoid(row_ptr, start + cols, V, False, FAST, TANH)
                    acc += _softmax_exp2(s * _EXP_MUL, FMA1, FAST)
                if V_FULL < V:
                    s = _chunk_sigmoid(row_ptr, V_FULL + cols, V, True, FAST, TANH)
                    acc += tl.where(V_FULL + cols < V, _softmax_exp2(s * _EXP_MUL, FMA1, FAST), 0.0)
                lse = tl.log(tl.sum(acc, axis=0))
                scale = w_total * 0.0 + 1.0  # the gradient is written whole: a unit row scale
                # every warp has read the slots' logits before any warp overwrites the row
                tl.debug_barrier()
                # pass 2: W p_j dz'/dz everywhere, in place
                lse2 = lse * _LOG2E_C
                grad_scale = w_total * DCAP
                for start in range(0, V_FULL, BLOCK_V):
                    _store_chunk_grad(row_ptr, start + cols, grad_scale, lse2, V, False, FMA2, FAST, TANH)
                if V_FULL < V:
                    _store_chunk_grad(row_ptr, V_FULL + cols, grad_scale, lse2, V, True, FMA2, FAST, TANH)
                # fix-up of the target columns, after every warp's pass-2 stores: subtract the
                # weights of all slots naming the column (equal columns get equal values)
                tl.debug_barrier()
                p_slot = _softmax_exp2(s_slot * _EXP_MUL - lse2, FMA2, FAST)
                dz_slot = (w_total * p_slot - sub) * (DCAP * s_slot * (1.0 - s_slot))
            tl.store(loss_ptr + row, w_total * lse - w_picked)
            tl.store(scale_ptr + row, scale)
            if STORE:
                tl.store(row_ptr + pos, dz_slot.to(z_ptr.dtype.element_ty), mask=slot <= N)


def interpreted() -> bool:
    """Whether the kernel runs in the Triton interpreter: TRITON_INTERPRET=1 was set before triton
    was imported (the only way CPU tensors can run it)."""
    return isinstance(_softcap_ce_rows, InterpretedFunction)


def _num_programs(device: torch.device, num_rows: int, programs_per_sm: int) -> int:
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    return max(1, min(num_rows, sms * programs_per_sm))


def check_targets(where: str, t: int, targets: Tensor, prefix_targets: Tensor, mtp_weights: Tensor,
                  prefix_weight: Tensor) -> None:
    """ValueError naming the argument (and `where`, the op) for target ids, MTP weights or the
    prefix weight the kernels cannot take, for T = t rows."""
    for name, ids in (("targets", targets), ("prefix_targets", prefix_targets)):
        if ids.dtype != torch.int64 or tuple(ids.shape) != (t,):
            raise ValueError(f"{where}: {name} needs int64 [T={t}], got {ids.dtype} {tuple(ids.shape)}")
    if mtp_weights.dtype != torch.float32 or mtp_weights.dim() != 1 or mtp_weights.shape[0] < 1:
        raise ValueError(f"{where}: mtp_weights needs float32 [N >= 1], got {mtp_weights.dtype} "
                         f"{tuple(mtp_weights.shape)}")
    if prefix_weight.dtype != torch.float32 or prefix_weight.dim() != 0:
        raise ValueError(f"{where}: prefix_weight needs a float32 0-d tensor, got {prefix_weight.dtype} "
                         f"{tuple(prefix_weight.shape)}")


def _check_inputs(x: Tensor, w: Tensor, targets: Tensor, mtp_weights: Tensor, prefix_weight: Tensor,
                  prefix_targets: Tensor) -> None:
    """ValueError naming the argument for every input the kernel cannot take (shapes, dtypes,
    devices; runs on fake tensors at trace time, so it costs nothing per step)."""
    where = "linear_softcap_ce"
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"{where}: needs x [T, D] and w [D, V], got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype != w.dtype or x.dtype not in DTYPES:
        raise ValueError(f"{where}: x and w need one dtype of {DTYPES} (the logit gradient is stored in "
                         f"it), got {x.dtype} and {w.dtype}; cast the lm head and its input")
    t = x.shape[0]
    if t == 0 or w.shape[1] == 0:
        raise ValueError(f"{where}: empty input, x {tuple(x.shape)}, w {tuple(w.shape)}")
    check_targets(where, t, targets, prefix_targets, mtp_weights, prefix_weight)
    devices = {a.device for a in (x, w, targets, mtp_weights, prefix_weight, prefix_targets)}
    if len(devices) != 1:
        raise ValueError(f"{where}: all inputs on one device, got {sorted(map(str, devices))}")
    if x.device.type not in ("cuda", "cpu"):
        raise ValueError(f"{where}: runs on CUDA (or the CPU through the Triton interpreter), got {x.device}")


def softcap_ce_rows_(z: Tensor, targets: Tensor, mtp_weights: Tensor, prefix_weight: Tensor,
                     prefix_targets: Tensor, launch: LaunchConfig) -> tuple[Tensor, Tensor]:
    """The kernel alone: (per-token loss float32 [T], row scale float32 [T]) of the logits z
    [T, V] (contiguous, bf16 or float32), and z overwritten IN PLACE with dloss/dz for a unit
    upstream gradient divided by the row scale (dloss/dz = scale[:, None] * z afterwards; the
    scale is 1 unless launch.one_pass); with launch.recompute z is left as it is (the logits).
    The op's forward after its GEMM; bench/loss_kernel.py times it on its own."""
    (t, v), n = z.shape, mtp_weights.shape[0]
    cuda = z.device.type == "cuda"
    if not cuda and not interpreted():
        raise ValueError("linear_softcap_ce: CPU tensors run only in the Triton interpreter: set "
                         "TRITON_INTERPRET=1 before triton is imported (tests/softcap_ce_cases.py, "
                         "bench/loss_kernel.py --smoke do); otherwise use model/loss.py's torch path")
    if not z.is_contiguous():
        raise ValueError(f"softcap_ce_rows_: z needs to be contiguous, got strides {z.stride()}")
    loss = torch.empty(t, dtype=torch.float32, device=z.device)  # [T]
    scale = torch.empty(t, dtype=torch.float32, device=z.device)  # [T]
    num_programs = _num_programs(z.device, t, launch.programs_per_sm)
    with torch.cuda.device(z.device) if cuda else contextlib.nullcontext():
        _softcap_ce_rows[(num_programs,)](z, targets.contiguous(), prefix_targets.contiguous(),
                                          mtp_weights.contiguous(), prefix_weight, loss, scale, t, V=v,
                                          ROWS_PER_PROGRAM=triton.cdiv(t, num_programs),
                                          N=n, NS=triton.next_power_of_2(n + 1),
                                          BLOCK_V=launch.block_v, FMA1=launch.fma_exp_passes >= 2,
                                          FMA2=launch.fma_exp_passes >= 1,
                                          FAST=launch.fast_math and cuda,
                                          TANH=launch.tanh_sigmoid, ONE_PASS=launch.one_pass,
                                          STORE=not launch.recompute, num_warps=launch.num_warps)
    return loss, scale


@torch.library.custom_op("t1s::linear_softcap_ce", mutates_args=())
def linear_softcap_ce_op(x: Tensor, w: Tensor, targets: Tensor, mtp_weights: Tensor,
                         prefix_weight: Tensor, prefix_targets: Tensor, block_v: int, num_warps: int,
                         programs_per_sm: int, fast_math: bool, fma_exp_passes: int,
                         tanh_sigmoid: bool = False, one_pass: bool = False, recompute: bool = False
                         ) -> tuple[Tensor, Tensor, Tensor]:
    """(loss float32 [T], dz [T, V] in x's dtype, row scale float32 [T]): the forward of
    linear_softcap_ce (module docstring). scale[:, None] * dz is dloss/dz for a unit upstream
    gradient; dz is written over the logits. ValueError with recompute (the fp8 head's)."""
    _check_inputs(x, w, targets, mtp_weights, prefix_weight, prefix_targets)
    _refuse_recompute(recompute)
    z = torch.mm(x, w)  # [T, V]; overwritten with dz by the kernel
    launch = LaunchConfig.from_op_args(block_v, num_warps, programs_per_sm, fast_math, fma_exp_passes,
                                       tanh_sigmoid, one_pass, recompute)
    loss, scale = softcap_ce_rows_(z, targets, mtp_weights, prefix_weight, prefix_targets, launch)
    return loss, z, scale


@linear_softcap_ce_op.register_fake
def _linear_softcap_ce_fake(x, w, targets, mtp_weights, prefix_weight, prefix_targets, block_v,
                            num_warps, programs_per_sm, fast_math, fma_exp_passes, tanh_sigmoid=False,
                            one_pass=False, recompute=False):
    _check_inputs(x, w, targets, mtp_weights, prefix_weight, prefix_targets)
    _refuse_recompute(recompute)
    t = x.shape[0]
    return (x.new_empty(t, dtype=torch.float32), x.new_empty(t, w.shape[1]),
            x.new_empty(t, dtype=torch.float32))


def _refuse_recompute(recompute: bool) -> None:
    if recompute:
        raise ValueError("linear_softcap_ce: LaunchConfig.recompute is the fp8 lm head's schedule "
                         "(kernels/softcap_ce_fp8.py); the bf16 head's backward GEMMs need the "
                         "gradient the forward writes: use one_pass without recompute")


def _setup_context(ctx, inputs, output):
    x, w = inputs[0], inputs[1]
    ctx.num_inputs = len(inputs)
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.save_for_backward(x, w, output[1], output[2])


def _backward(ctx, g_loss: Tensor, _g_dz: Tensor, _g_scale: Tensor):
    x, w, dz, scale = ctx.saved_tensors  # [T, D], [D, V], [T, V], [T]
    g = (g_loss.float() * scale)[:, None]  # [T, 1]: the upstream gradient times the row scale
    dx = (torch.mm(dz, w.t()) * g).to(x.dtype) if ctx.needs_input_grad[0] else None  # [T, D]
    dw = torch.mm((x * g).to(x.dtype).t(), dz) if ctx.needs_input_grad[1] else None  # [D, V]
    return dx, dw, *([None] * (ctx.num_inputs - 2))


linear_softcap_ce_op.register_autograd(_backward, setup_context=_setup_context)


def linear_softcap_ce(x: Tensor, w: Tensor, targets: Tensor, mtp_weights: Tensor,
                      prefix_weight: Tensor, prefix_targets: Tensor, *,
                      launch: LaunchConfig = DEFAULT_LAUNCH) -> Tensor:
    """Per-token training loss float32 [T] of softcap(x @ w), differentiable in x and w; equal to
    model/loss.py's `training_loss(softcap(x @ w), targets, mtp_weights, prefix_weight,
    prefix_targets)` up to float32 rounding (and the bf16 rounding of the logit gradient).

    x [T, D] and w [D, V] in one dtype (bf16 in training; float32 too), targets int64 [T] in
    [0, V), mtp_weights float32 [N] (device tensor, N >= 1), prefix_weight float32 0-d (device
    tensor), prefix_targets int64 [T] in [-1, V) (-1: no prefix term). ValueError for anything
    else. Ids are not range-checked here (one out of range reads another row's logit): the batch's
    token ids, of which targets are the shift, are checked in NgramTable.slots_for, and prefix ids
    come from build_prefix_table."""
    return linear_softcap_ce_op(x, w, targets, mtp_weights, prefix_weight, prefix_targets,
                                *launch.op_args())[0]
