"""Fused lm-head + softcapped cross-entropy (MTP and prefix terms): one Triton kernel that writes
the per-token loss and the logit gradient in the forward, so the backward is two GEMMs.

What it replaces: the training path of GPT.forward, `training_loss(softcap(x @ lm_head), targets,
mtp_weights, prefix_weight, prefix_table[targets])` (model/loss.py, the slow reference, which
tests/test_softcap_ce.py and tests/test_softcap_ce_gpu.py check this against). Why faster: the
torch path runs ~16.5 ms per stage-C micro-step (T=49,152) outside the GEMMs, because its
backward builds two dense float32 [T, V] tensors; the public record (modded-nanogpt HEAD,
FusedSoftcappedCrossEntropy, triton_kernels.py:906-1292; facts 1.6) does the loss in ~3.2 ms
with one kernel that writes the logit gradient in the forward. Floor: one read and one write of
the bf16 logits (4.9 GB at stage C) ~ 2.3 ms at ~4.3 TB/s. Measured: bench/loss_kernel.py
(docs/results/, H200 numbers once the lead has run it).

How it works (one definition for eager, torch.compile and CUDA-graph capture):
    forward   z = x @ w                                    bf16 GEMM (torch.mm) -> [T, V]
              kernel, one program per row (persistent: rows pid, pid + P, ...):
                read the row's picked logits (targets[t + k], prefix_t) and weights
                pass 1 over V in BLOCK_V chunks: S_t = sum_j exp(z'_tj)  -> lse_t, loss_t
                pass 2 over V: dz_tj = dL_t/dz_tj, written IN PLACE over z (z.dtype)
              returns (loss [T] float32, dz [T, V]); dz is saved for the backward
    backward  upstream g [T]: row scaling commutes with the GEMMs, so
              dx = g[:, None] * (dz @ w^T)    dw = (g[:, None] * x)^T @ dz
              (two GEMMs and [T, D] scalings, no [T, V] elementwise pass)
No max pass: z' lies in (0, 23), so exp(z') <= e^23 ~ 1e10 and the float32 sum over V = 50,304
stays below 5e14. The second pass re-reads a row the first pass read moments before; with few
rows in flight (programs_per_sm x SMs rows of 100 KB) it is served from L2, so HBM sees about
one read and one write of the logits.

Math (equal to model/loss.py up to float32 rounding; N = len(mtp_weights), shapes below):
    z'_tj = 23 * sigmoid((z_tj + 5) / 7.5)        lse_t = log sum_j exp(z'_tj)
    w_tk  = mtp_weights[k] * [t + k < T]          w_tp = prefix_weight * [prefix_t >= 0]
    W_t   = sum_k w_tk + w_tp
    loss_t = sum_k w_tk (lse_t - z'_t[targets[t + k]]) + w_tp (lse_t - z'_t[prefix_t])
           = W_t lse_t - (sum_k w_tk z'_t[targets[t + k]] + w_tp z'_t[prefix_t])   (as computed)
    dloss_t/dz_tj = (W_t softmax(z'_t)_j - sum_k w_tk [j = targets[t + k]] - w_tp [j = prefix_t])
                    * z'_tj (23 - z'_tj) / (23 * 7.5)
The gradient is rounded to z's dtype (bf16 in training: relative 2^-9 per element, like the
record, which rounds it to fp8 e5m2). Unlike the record's backward, which ignores grad_output,
this one applies the upstream gradient exactly, so the loss is an ordinary differentiable tensor.

What must stay stable: nothing here owns memory across calls (every call allocates z/dz and the
loss; under CUDA graphs they live in the graph pool). mtp_weights and prefix_weight are device
tensors read by the kernel (values may change between replays; never read on the host); N is a
shape (one compiled kernel per N). No host sync, no data-dependent shapes. The Triton kernel
compiles at its first call per (dtype, N, launch config): call it once before capture (the
project's warmup does).

Registration: `t1s::linear_softcap_ce` is a torch.library.custom_op with a fake (meta) kernel and
an autograd formula, so torch.compile(fullgraph=True) keeps it as one opaque extern call and
AOTAutograd traces the backward's GEMMs. Output dz of the raw op is not differentiable.

Plugging in (the lead installs it from outside the model, as a loss strategy): in GPT.forward's
full-softmax training branch (bf16 head, fp8 off for the lm head),
    loss = linear_softcap_ce(x, self.lm_head, targets, cfg.mtp_weights, cfg.prefix_weight,
                             self.prefix_table[targets])           # [T] float32
replaces `training_loss(softcap(x @ lm_head), ...)`; the trainer's loss.sum().backward() is
unchanged.

CPU: the kernel runs on CPU tensors only in the Triton interpreter, i.e. when TRITON_INTERPRET=1
was set before triton was first imported (triton decides at decoration time, also for its own
library functions); tests/softcap_ce_cases.py and bench/loss_kernel.py --smoke run that way in
their own processes. Otherwise a CPU call is a ValueError.

Deviations from the record: bf16 GEMMs and a bf16 logit gradient (the record: fp8 e4m3 GEMM,
e5m2 gradient); a persistent Triton kernel over V chunks instead of an NVRTC kernel holding a
whole row of sigmoids in shared memory; the upstream gradient is honoured.

Legend: T tokens, D model dim, V vocab (padded), N MTP targets, P programs of the kernel.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from track_1_short.model.loss import SOFTCAP_DIV, SOFTCAP_SCALE, SOFTCAP_SHIFT

_LOG2E = 1.0 / math.log(2.0)
# z' = 23 sigmoid((z + 5) / 7.5) = 23 s, s = 1 / (1 + 2^(z * _ARG_MUL + _ARG_ADD)); exp(z') = 2^(s * _EXP_MUL)
_ARG_MUL = tl.constexpr(-_LOG2E / SOFTCAP_DIV)
_ARG_ADD = tl.constexpr(-SOFTCAP_SHIFT * _LOG2E / SOFTCAP_DIV)
_SCALE = tl.constexpr(SOFTCAP_SCALE)
_EXP_MUL = tl.constexpr(SOFTCAP_SCALE * _LOG2E)
_LOG2E_C = tl.constexpr(_LOG2E)
_DCAP = tl.constexpr(SOFTCAP_SCALE / SOFTCAP_DIV)  # dz'/dz = (23 / 7.5) s (1 - s)

DTYPES = (torch.bfloat16, torch.float32)


@dataclass(slots=True, frozen=True, kw_only=True)
class LaunchConfig:
    """Launch shape of the kernel. Defaults chosen for the H200 at V = 50,304 (bench/loss_kernel.py
    --sweep times alternatives): 2 rows in flight per SM keep ~26 MB of rows in the 50 MB L2
    between the two passes."""

    block_v: int = 4096  # columns per chunk (power of two); 8 bf16 per thread at 16 warps
    num_warps: int = 16
    programs_per_sm: int = 2  # P = min(T, SMs * programs_per_sm); on the CPU SMs counts as 1

    def __post_init__(self):
        if self.block_v < 16 or self.block_v & (self.block_v - 1):
            raise ValueError(f"LaunchConfig.block_v={self.block_v}: needs a power of two >= 16")
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"LaunchConfig.num_warps={self.num_warps}: choose 1, 2, 4, 8, 16 or 32")
        if self.programs_per_sm < 1:
            raise ValueError(f"LaunchConfig.programs_per_sm={self.programs_per_sm}: needs >= 1")


DEFAULT_LAUNCH = LaunchConfig()


@triton.jit
def _sigmoid_of_logit(z):
    """float32 z -> s = sigmoid((z + 5) / 7.5), so z' = 23 s and exp(z') = 2^(s * _EXP_MUL)."""
    return 1.0 / (1.0 + tl.exp2(z * _ARG_MUL + _ARG_ADD))


@triton.jit
def _softcap_ce_rows(z_ptr, targets_ptr, prefix_ptr, mtp_w_ptr, prefix_w_ptr, loss_ptr, T,
                     V: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr, N: tl.constexpr,
                     BLOCK_V: tl.constexpr):
    cols = tl.arange(0, BLOCK_V)
    pw = tl.load(prefix_w_ptr)
    # rows pid, pid + P, ...; loop bounds are constexprs: the interpreter turns int arguments into
    # 1-element arrays, which `range` cannot take under numpy >= 2.4
    for i in range(0, ROWS_PER_PROGRAM):
        row = tl.program_id(0) + i * tl.num_programs(0)
        if row < T:
            row_ptr = z_ptr + row.to(tl.int64) * V
            # weights and picked logits first: pass 2 overwrites the row
            pfx = tl.load(prefix_ptr + row)
            w_p = tl.where(pfx >= 0, pw, 0.0)
            z_p = tl.load(row_ptr + tl.maximum(pfx, 0)).to(tl.float32)
            w_total = w_p
            w_picked = w_p * _SCALE * _sigmoid_of_logit(z_p)  # w_tp z'_t[prefix_t]
            for k in tl.static_range(N):
                ok = row + k < T
                tgt = tl.load(targets_ptr + row + k, mask=ok, other=0)
                w_k = tl.where(ok, tl.load(mtp_w_ptr + k), 0.0)
                z_k = tl.load(row_ptr + tgt).to(tl.float32)
                w_total += w_k
                w_picked += w_k * _SCALE * _sigmoid_of_logit(z_k)
            # pass 1: S = sum_j exp(z'_j) (z' < 23: no max needed)
            acc = tl.zeros([BLOCK_V], dtype=tl.float32)
            for start in range(0, V, BLOCK_V):
                c = start + cols
                m = c < V
                s = _sigmoid_of_logit(tl.load(row_ptr + c, mask=m, other=0.0).to(tl.float32))
                acc += tl.where(m, tl.exp2(s * _EXP_MUL), 0.0)
            lse = tl.log(tl.sum(acc, axis=0))
            tl.store(loss_ptr + row, w_total * lse - w_picked)
            # every warp has read the picked logits before any warp overwrites the row
            tl.debug_barrier()
            # pass 2: dz_j = (W p_j - onehots_j) dz'/dz, in place
            lse2 = lse * _LOG2E_C
            for start in range(0, V, BLOCK_V):
                c = start + cols
                m = c < V
                s = _sigmoid_of_logit(tl.load(row_ptr + c, mask=m, other=0.0).to(tl.float32))
                coef = w_total * tl.exp2(s * _EXP_MUL - lse2) - tl.where(c == pfx, w_p, 0.0)
                for k in tl.static_range(N):
                    ok = row + k < T
                    tgt = tl.load(targets_ptr + row + k, mask=ok, other=-1)
                    w_k = tl.where(ok, tl.load(mtp_w_ptr + k), 0.0)
                    coef -= tl.where(c == tgt, w_k, 0.0)
                dz = coef * (_DCAP * s * (1.0 - s))
                tl.store(row_ptr + c, dz.to(z_ptr.dtype.element_ty), mask=m)


def interpreted() -> bool:
    """Whether the kernel runs in the Triton interpreter: TRITON_INTERPRET=1 was set before triton
    was imported (the only way CPU tensors can run it)."""
    return isinstance(_softcap_ce_rows, InterpretedFunction)


def _num_programs(device: torch.device, num_rows: int, programs_per_sm: int) -> int:
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    return max(1, min(num_rows, sms * programs_per_sm))


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
    for name, ids in (("targets", targets), ("prefix_targets", prefix_targets)):
        if ids.dtype != torch.int64 or tuple(ids.shape) != (t,):
            raise ValueError(f"{where}: {name} needs int64 [T={t}], got {ids.dtype} {tuple(ids.shape)}")
    if mtp_weights.dtype != torch.float32 or mtp_weights.dim() != 1 or mtp_weights.shape[0] < 1:
        raise ValueError(f"{where}: mtp_weights needs float32 [N >= 1], got {mtp_weights.dtype} "
                         f"{tuple(mtp_weights.shape)}")
    if prefix_weight.dtype != torch.float32 or prefix_weight.dim() != 0:
        raise ValueError(f"{where}: prefix_weight needs a float32 0-d tensor, got {prefix_weight.dtype} "
                         f"{tuple(prefix_weight.shape)}")
    devices = {a.device for a in (x, w, targets, mtp_weights, prefix_weight, prefix_targets)}
    if len(devices) != 1:
        raise ValueError(f"{where}: all inputs on one device, got {sorted(map(str, devices))}")
    if x.device.type not in ("cuda", "cpu"):
        raise ValueError(f"{where}: runs on CUDA (or the CPU through the Triton interpreter), got {x.device}")


def softcap_ce_rows_(z: Tensor, targets: Tensor, mtp_weights: Tensor, prefix_weight: Tensor,
                     prefix_targets: Tensor, launch: LaunchConfig) -> Tensor:
    """The kernel alone: per-token loss float32 [T] of the logits z [T, V] (contiguous, bf16 or
    float32), and z overwritten IN PLACE with dloss/dz for a unit upstream gradient. The op's
    forward after its GEMM; bench/loss_kernel.py times it on its own."""
    t, v = z.shape
    cuda = z.device.type == "cuda"
    if not cuda and not interpreted():
        raise ValueError("linear_softcap_ce: CPU tensors run only in the Triton interpreter: set "
                         "TRITON_INTERPRET=1 before triton is imported (tests/softcap_ce_cases.py, "
                         "bench/loss_kernel.py --smoke do); otherwise use model/loss.py's torch path")
    if not z.is_contiguous():
        raise ValueError(f"softcap_ce_rows_: z needs to be contiguous, got strides {z.stride()}")
    loss = torch.empty(t, dtype=torch.float32, device=z.device)  # [T]
    num_programs = _num_programs(z.device, t, launch.programs_per_sm)
    with torch.cuda.device(z.device) if cuda else contextlib.nullcontext():
        _softcap_ce_rows[(num_programs,)](z, targets.contiguous(), prefix_targets.contiguous(),
                                          mtp_weights.contiguous(), prefix_weight, loss, t, V=v,
                                          ROWS_PER_PROGRAM=triton.cdiv(t, num_programs),
                                          N=mtp_weights.shape[0], BLOCK_V=launch.block_v,
                                          num_warps=launch.num_warps)
    return loss


@torch.library.custom_op("t1s::linear_softcap_ce", mutates_args=())
def linear_softcap_ce_op(x: Tensor, w: Tensor, targets: Tensor, mtp_weights: Tensor,
                         prefix_weight: Tensor, prefix_targets: Tensor, block_v: int, num_warps: int,
                         programs_per_sm: int) -> tuple[Tensor, Tensor]:
    """(loss float32 [T], dz [T, V] in x's dtype): the forward of linear_softcap_ce (module
    docstring). dz is dloss/dz for a unit upstream gradient, written over the logits."""
    _check_inputs(x, w, targets, mtp_weights, prefix_weight, prefix_targets)
    z = torch.mm(x, w)  # [T, V]; overwritten with dz by the kernel
    loss = softcap_ce_rows_(z, targets, mtp_weights, prefix_weight, prefix_targets,
                            LaunchConfig(block_v=block_v, num_warps=num_warps,
                                         programs_per_sm=programs_per_sm))
    return loss, z


@linear_softcap_ce_op.register_fake
def _linear_softcap_ce_fake(x, w, targets, mtp_weights, prefix_weight, prefix_targets, block_v,
                            num_warps, programs_per_sm):
    _check_inputs(x, w, targets, mtp_weights, prefix_weight, prefix_targets)
    return x.new_empty(x.shape[0], dtype=torch.float32), x.new_empty(x.shape[0], w.shape[1])


def _setup_context(ctx, inputs, output):
    x, w = inputs[0], inputs[1]
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(x, w, output[1])


def _backward(ctx, g_loss: Tensor, _g_dz: Tensor):
    x, w, dz = ctx.saved_tensors  # [T, D], [D, V], [T, V]
    g = g_loss.float()[:, None]  # [T, 1]
    dx = (torch.mm(dz, w.t()) * g).to(x.dtype) if ctx.needs_input_grad[0] else None  # [T, D]
    dw = torch.mm((x * g).to(x.dtype).t(), dz) if ctx.needs_input_grad[1] else None  # [D, V]
    return dx, dw, None, None, None, None, None, None, None


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
                                launch.block_v, launch.num_warps, launch.programs_per_sm)[0]
