"""fp8 quantisation into both GEMM layouts in one pass: one Triton kernel reads a tile of t once and
writes its fp8 values row-major and column-major.

What it replaces: in the fp8 lm head's backward (kernels/softcap_ce_fp8.py) the graph code
`g8 = quantise(dz * g[:, None], grad_s, E5M2)`, then `row_major(g8)` for grad_x and
`col_major(g8)` for grad_w (model/fp8.py). Inductor fuses that into one pointwise kernel which
writes one of the two layouts transposed, element-strided: measured 4.5 ms per stage-C
micro-step on one H200 (T x V = 49,152 x 50,304: it reads the bf16 dz, 4.9 GB, and writes
2 x 2.47 GB, ~2.2 TB/s). Here both writes are coalesced; expected ~2.5-3 ms at the H200's
~4 TB/s. Speed (tests/test_softcap_ce_fp8_gpu.py at stage C, one H200,
docs/results/gpu_tests_fp8_h200_2026-12-02.log): 3.43 ms (4.31 ms with the bit rounding), against
4.38 ms for the inductor-compiled reference; bitwise equal to eager in both roundings.

How it works (one program per [BLOCK_R, BLOCK_C] tile of t, row tiles outer, column tiles inner):
    v = float32(t[r, c])                                    (bf16 or float32 t, any strides)
    v = v * row_mul[r]                                      (when row_mul is given)
    v = v / scale                                           (IEEE division, tl.div_rn)
    v = clamp(v, -FP8_MAX, FP8_MAX)                         (model/fp8.py FP8_MAX[dtype])
    q = v rounded to the fp8 dtype, to nearest even
    row[r, c] = q   (strides (C, 1))      col[r, c] = q   (strides (1, R))
The float32 operations are those of the reference, in its order, so the result is BITWISE the
reference's: the multiply is t * row_mul[:, None]'s (bf16 promotes to float32 exactly), the
division is IEEE like eager torch's (torch.compile's own kernel for the reference divides with
Triton's approximate `/` unless TORCHINDUCTOR_EMULATE_DIVISION_ROUNDING=1, so it can differ from
eager by one fp8 step where a quotient lies within ~2 float32 ulps of a rounding boundary).
The row-major store is coalesced along c as loaded. The column-major store reads the fp8 tile
back from the row-major output the program has just written (behind a CTA barrier; expected to
hit in L2) and Triton converts that tile's register layout through shared memory so that the
store is coalesced along r. Storing the computed registers directly instead makes Triton's layout pass
(RemoveLayoutConversions' cost model) recompute the whole chain, loads to rounding, in the second
layout: counted in the SASS of the kernel compiled for sm_90 (here, without a GPU), 128 instead
of 64 IEEE division sequences and ~2,900 instead of ~1,700 instructions per thread (8 warps, a
128 x 128 tile of bf16 with row_mul), i.e. ~3.3 instead of ~1.9 ms of instruction issue at stage
C (estimated from the counts): issue-bound rather than memory-bound. A 128 x 128 tile writes
whole 128-byte lines in both layouts; the re-read should cost L2 traffic only (not measured).
The fp8 rounding (QuantiseLaunch.hw_cast): on CUDA the hardware conversion (cvt.rn.satfinite,
Triton's float32 -> fp8 cast with round-to-nearest-even); in the Triton interpreter, whose fp8
cast is not round-to-nearest-even (triton 3.6 runtime/interpreter.py _convert_float rounds half
up and mishandles the mantissa carry), `_round_to_fp8_bits`: c10's float32 -> fp8 conversion
(c10/util/Float8_e5m2.h, Float8_e4m3fn.h) on the bits, which is what torch's own cast computes.
tests/test_softcap_ce_fp8_gpu.py checks both variants on the GPU against the reference.

Slow reference: `quantise_both_layouts_reference` below, i.e. model/fp8.py's own functions:
quantise(t * row_mul[:, None] or t, scale, dtype), then row_major and col_major of the result
(tests/fp8_quantise_cases.py checks the kernel bitwise against it in the Triton interpreter,
tests/test_softcap_ce_fp8_gpu.py on the H200).

What must stay stable: nothing is owned across calls; every call allocates its two outputs (under
CUDA graphs they live in the graph pool). `scale` and `row_mul` are device tensors read by the
kernel (values may change between replays; never read on the host). No host sync, no
data-dependent shape. The kernel compiles at its first call per (dtypes, row_mul or not, launch
config, Triton's specialisation of R, C and the strides): call it once per key before capture
(the project's warmup does).

Registration: `t1s::fp8_quantise_both_layouts` is a torch.library.custom_op with a fake (meta)
kernel (outputs by torch.empty / torch.empty_strided with the layouts above), no autograd (it runs
inside backward formulas), so torch.compile(fullgraph=True) keeps it as one opaque extern call
and CUDA graphs capture it.

CPU: like kernels/softcap_ce.py, the kernel runs on CPU tensors only in the Triton interpreter
(TRITON_INTERPRET=1 set before triton is first imported); tests/fp8_quantise_cases.py and
tests/softcap_ce_cases.py run that way in their own processes. Otherwise a CPU call is a
ValueError (the CPU path is the reference); the fake kernel runs anywhere, so CPU tests trace the
op on fake tensors.

Legend: R rows, C columns of t (the lm head: R = T tokens, C = V vocab), BLOCK_R x BLOCK_C the
tile of one program.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from track_1_short.model.fp8 import E4M3, E5M2, FP8_MAX, col_major, quantise, row_major

IN_DTYPES = (torch.bfloat16, torch.float32)
OUT_DTYPES = (E5M2, E4M3)
MANTISSA_BITS = {E5M2: 2, E4M3: 3}
EXPONENT_BIAS = {E5M2: 15, E4M3: 7}


@dataclass(slots=True, frozen=True, kw_only=True)
class QuantiseLaunch:
    """Tile and rounding variant of the kernel. Defaults: not tuned yet (a 128 x 128 tile writes
    whole 128-byte lines in both layouts; module docstring)."""

    block_r: int = 128  # rows per tile (power of two)
    block_c: int = 128  # columns per tile (power of two)
    num_warps: int = 8
    # CUDA: the hardware fp8 conversion; False: _round_to_fp8_bits (the interpreter always runs it)
    hw_cast: bool = True

    def __post_init__(self):
        for name in ("block_r", "block_c"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"QuantiseLaunch.{name}={value}: needs a power of two")
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"QuantiseLaunch.num_warps={self.num_warps}: choose 1, 2, 4, 8, 16 or 32")


DEFAULT_LAUNCH = QuantiseLaunch()


@triton.jit
def _round_to_fp8_bits(v, MANT: tl.constexpr, BIAS: tl.constexpr):
    """float32 v (finite values within the format's range, or NaN) -> int32 bit patterns of the
    fp8 format with MANT mantissa bits and exponent bias BIAS, rounded to nearest even: c10's
    conversion (module docstring), integer and float32 arithmetic that is exact on every backend."""
    bits = v.to(tl.int32, bitcast=True)
    a = bits & 0x7FFFFFFF  # |v|
    # below the smallest normal 2^(1 - BIAS): |v| + 2^(24 - BIAS - MANT), whose float32 ulp is the
    # format's subnormal step 2^(1 - BIAS - MANT), rounds |v| to a subnormal (or the smallest
    # normal) in the float addition itself; the sum's low bits are then the fp8 bits
    denorm_bits: tl.constexpr = (151 - BIAS - MANT) << 23  # 2^(24 - BIAS - MANT) as float32 bits
    denorm = tl.full([], denorm_bits, tl.int32).to(tl.float32, bitcast=True)
    sub = (a.to(tl.float32, bitcast=True) + denorm).to(tl.int32, bitcast=True) - denorm_bits
    # normal: re-bias the exponent, add half an fp8 ulp minus one plus the kept mantissa's lowest
    # bit (ties to even), keep the top bits
    odd = (a >> (23 - MANT)) & 1
    normal = (a - ((127 - BIAS) << 23) + ((1 << (22 - MANT)) - 1) + odd) >> (23 - MANT)
    q = tl.where(a < ((128 - BIAS) << 23), sub, normal)
    q = tl.where(a > 0x7F800000, 0x7F, q)  # NaN (the clamp passes it through): c10's 0x7F
    return q | tl.where(bits < 0, 0x80, 0)


@triton.jit
def _quantise_both_layouts(t_ptr, m_ptr, scale_ptr, row_ptr, col_ptr, R, C, stride_tr, stride_tc,
                           stride_m, FMAX: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr,
                           HAS_MUL: tl.constexpr, HW_CAST: tl.constexpr, BLOCK_R: tl.constexpr,
                           BLOCK_C: tl.constexpr):
    r, r_ok, mask, r64, c64 = program_tile(R, C, BLOCK_R, BLOCK_C)
    v = tl.load(t_ptr + r64 * stride_tr + c64 * stride_tc, mask=mask, other=0.0).to(tl.float32)
    if HAS_MUL:
        v = v * tl.load(m_ptr + r.to(tl.int64) * stride_m, mask=r_ok, other=0.0)[:, None]
    q = to_fp8(tl.div_rn(v, tl.load(scale_ptr)), row_ptr.dtype.element_ty, FMAX, MANT, BIAS, HW_CAST)
    store_both_layouts(row_ptr, col_ptr, q, r64, c64, R, C, mask)


@triton.jit
def program_tile(R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's [BLOCK_R, BLOCK_C] tile of an [R, C] matrix (row tiles outer, column tiles
    inner): (r [BLOCK_R] rows, r_ok [BLOCK_R], mask [BLOCK_R, BLOCK_C], r64 [BLOCK_R, 1] and c64
    [1, BLOCK_C] int64 indices: R x C exceeds 2^31 at stage C)."""
    pid = tl.program_id(0)
    tiles_c = tl.cdiv(C, BLOCK_C)
    r = (pid // tiles_c) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    c = (pid % tiles_c) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C]
    r_ok = r < R
    mask = r_ok[:, None] & (c < C)[None, :]  # [BLOCK_R, BLOCK_C]
    return r, r_ok, mask, r.to(tl.int64)[:, None], c.to(tl.int64)[None, :]


@triton.jit
def to_fp8(v, out_ty: tl.constexpr, FMAX: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr,
           HW_CAST: tl.constexpr):
    """float32 v (already divided by the scale) clamped to +-FMAX and rounded to the fp8 dtype
    out_ty, to nearest even: the hardware cast (HW_CAST) or the bit rounding (module docstring)."""
    v = tl.clamp(v, -FMAX, FMAX, propagate_nan=tl.PropagateNan.ALL)
    if HW_CAST:
        return v.to(out_ty)  # round to nearest even (Triton's default for fp8 downcasts)
    else:
        return _round_to_fp8_bits(v, MANT, BIAS).to(tl.uint8).to(out_ty, bitcast=True)


@triton.jit
def store_both_layouts(row_ptr, col_ptr, q, r64, c64, R, C, mask):
    """The fp8 tile q [BLOCK_R, BLOCK_C] at rows r64 [BLOCK_R, 1] and columns c64 [1, BLOCK_C]
    (int64) of an [R, C] matrix into row (strides (C, 1)) and col (strides (1, R)), both stores
    coalesced (module docstring, "How it works")."""
    row_offs = r64 * C + c64  # [BLOCK_R, BLOCK_C] into row, strides (C, 1)
    tl.store(row_ptr + row_offs, q, mask=mask)
    # the column-major copy from the tile just written: after the barrier every thread's stores
    # are visible to the whole program
    tl.debug_barrier()
    tl.store(col_ptr + r64 + c64 * R, tl.load(row_ptr + row_offs, mask=mask), mask=mask)  # (1, R)


def interpreted() -> bool:
    """Whether the kernel runs in the Triton interpreter: TRITON_INTERPRET=1 was set before triton
    was imported (the only way CPU tensors can run it)."""
    return isinstance(_quantise_both_layouts, InterpretedFunction)


def _check_inputs(t: Tensor, scale: Tensor, row_mul: Tensor | None, dtype: torch.dtype) -> None:
    """ValueError naming the argument for every input the kernel cannot take (runs on fake tensors
    at trace time too, so it costs nothing per step under torch.compile)."""
    where = "quantise_both_layouts"
    if t.dim() != 2:
        raise ValueError(f"{where}: t needs [R, C], got shape {tuple(t.shape)}")
    if t.dtype not in IN_DTYPES:
        raise ValueError(f"{where}: t needs a dtype of {IN_DTYPES}, got {t.dtype}")
    if t.shape[0] == 0 or t.shape[1] == 0:
        raise ValueError(f"{where}: t is empty, shape {tuple(t.shape)}")
    if t.device.type not in ("cuda", "cpu"):
        raise ValueError(f"{where}: t on CUDA (or the CPU through the Triton interpreter), got {t.device}")
    if dtype not in OUT_DTYPES:
        raise ValueError(f"{where}: dtype needs one of {OUT_DTYPES}, got {dtype}")
    if scale.dtype != torch.float32 or scale.dim() != 0 or scale.device != t.device:
        raise ValueError(f"{where}: scale needs a float32 0-d tensor on t's device {t.device}, got "
                         f"{scale.dtype} {tuple(scale.shape)} on {scale.device}")
    if row_mul is not None and (row_mul.dtype != torch.float32 or tuple(row_mul.shape) != (t.shape[0],)
                                or row_mul.device != t.device):
        raise ValueError(f"{where}: row_mul needs float32 [R={t.shape[0]}] on t's device {t.device}, "
                         f"got {row_mul.dtype} {tuple(row_mul.shape)} on {row_mul.device}")


@torch.library.custom_op("t1s::fp8_quantise_both_layouts", mutates_args=())
def quantise_both_layouts_op(t: Tensor, scale: Tensor, row_mul: Tensor | None, dtype: torch.dtype,
                             block_r: int, block_c: int, num_warps: int,
                             hw_cast: bool) -> tuple[Tensor, Tensor]:
    """(row [R, C] strides (C, 1), col [R, C] strides (1, R)), both `dtype`: t [R, C] times
    row_mul [R] (None: no multiply), divided by scale, clamped and rounded to fp8 (module
    docstring)."""
    _check_inputs(t, scale, row_mul, dtype)
    cuda = t.device.type == "cuda"
    if not cuda and not interpreted():
        raise ValueError("quantise_both_layouts: CPU tensors run only in the Triton interpreter: set "
                         "TRITON_INTERPRET=1 before triton is imported (tests/fp8_quantise_cases.py "
                         "does); otherwise use quantise_both_layouts_reference")
    (r, c) = t.shape
    row = torch.empty((r, c), dtype=dtype, device=t.device)  # [R, C] strides (C, 1)
    col = torch.empty_strided((r, c), (1, r), dtype=dtype, device=t.device)  # [R, C] strides (1, R)
    grid = (triton.cdiv(r, block_r) * triton.cdiv(c, block_c),)
    with torch.cuda.device(t.device) if cuda else contextlib.nullcontext():
        _quantise_both_layouts[grid](t, row_mul, scale, row, col, r, c,
                                     t.stride(0), t.stride(1),
                                     0 if row_mul is None else row_mul.stride(0),
                                     FMAX=FP8_MAX[dtype], MANT=MANTISSA_BITS[dtype],
                                     BIAS=EXPONENT_BIAS[dtype], HAS_MUL=row_mul is not None,
                                     HW_CAST=hw_cast and cuda, BLOCK_R=block_r, BLOCK_C=block_c,
                                     num_warps=num_warps)
    return row, col


@quantise_both_layouts_op.register_fake
def _quantise_both_layouts_fake(t, scale, row_mul, dtype, block_r, block_c, num_warps, hw_cast):
    _check_inputs(t, scale, row_mul, dtype)
    (r, c) = t.shape
    return (torch.empty((r, c), dtype=dtype, device=t.device),
            torch.empty_strided((r, c), (1, r), dtype=dtype, device=t.device))


def quantise_both_layouts(t: Tensor, scale: Tensor, dtype: torch.dtype, row_mul: Tensor | None = None,
                          *, launch: QuantiseLaunch = DEFAULT_LAUNCH) -> tuple[Tensor, Tensor]:
    """(row, col): t [R, C] (bf16 or float32, any strides) times row_mul [R] (float32, any stride;
    None: no multiply), divided by the dequantisation scale (float32 0-d device tensor), clamped
    to +-FP8_MAX[dtype] and rounded to `dtype` (e5m2 or e4m3), as row [R, C] with strides (C, 1)
    and col [R, C] with strides (1, R); bitwise equal to quantise_both_layouts_reference. Not
    differentiable. ValueError naming the argument for inputs it cannot take."""
    return quantise_both_layouts_op(t, scale, row_mul, dtype, launch.block_r, launch.block_c,
                                    launch.num_warps, launch.hw_cast)


def quantise_both_layouts_reference(t: Tensor, scale: Tensor, dtype: torch.dtype,
                                    row_mul: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Slow reference of quantise_both_layouts, from model/fp8.py's functions (any device)."""
    q = quantise(t if row_mul is None else t * row_mul[:, None], scale, dtype)  # [R, C]
    return row_major(q), col_major(q)
