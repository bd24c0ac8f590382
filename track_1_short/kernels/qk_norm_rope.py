"""q and k of one attention layer: per-head rms-norm, then the half-truncated interleaved RoPE
(model/yarn.py), written straight into the attention's layout, in one Triton pass forward and
one backward.

What it replaces (the reference, model/gpt.norm_rotate, which stays the definition):
`rms_norm(q), rms_norm(k)` over [T, H, D] views of the qk projection, then `Yarn.rotate` (or, on a
paired layer, `Yarn.rotate_doubled(pair_heads(.))`). Inductor compiles that into one or more
reductions that ran at ~2.5x their memory floor at stage C (one program of 64 threads per
(token, 3 heads); docs/LOG.md 2026-12-03, eighteenth session), three kernels plus copies on a
paired layer. Here each program normalises and rotates the head rows of BLOCK_POS output
positions (G = H rows per position, or H/2 paired, padded to a power of two GROUP_PAD and
masked): read the projection's [T, 2, H, D] once, write q and k once, and read each position's
table row once for its G head rows (a pair's two columns are split in registers: tl.split of
the row viewed [D/2, 2]). The first version ran one program per 16 head rows and loaded the
float32 table row for every head row: 2 KB of table per 512 B of activations moved, which held
the pair at ~60% of the memory floor (bench/qk_norm_rope.py measures both).

Math, per head row x [D] (float32 inside, the activations' dtype outside):
  forward   r = 1 / sqrt(mean(x^2) + eps), y = x r, each pair (a, b) = (y[2i], y[2i+1]) ->
            (a c_i - b s_i, b c_i + a s_i); c_i, s_i the table row of the position at 2i,
            rounded to the activations' dtype first as Yarn.rotate does (`cos.to(x.dtype)`);
            eps = finfo(float32).eps, F.rms_norm's default (its opmath type's).
  backward  per pair of the gradient (ga, gb) -> dy = (ga c_i + gb s_i, gb c_i - ga s_i) (the
            rotation's transpose), dx = r (dy - y mean(dy y)).
Layouts: the input qk [T, 2, H, D] contiguous (the projection's output viewed), row (t, s, h).
Outputs q and k, each [T*H, D] (R rows) and its own tensor; unpaired each is [T, H, D] (position
t); paired each is attention.pair_heads' [2T, H/2, D], row (2t + j, p) holding head 2p + j at
doubled position 2t + j, whose table is the paired table read as [2P, D] (Yarn.head_tables, as
Yarn.rotate_doubled). Two tensors, not two views of one: autograd then hands the backward q's and
k's gradients as they are. Views of one [2, R, D] output made it assemble that output's gradient
from two select_backward and an add, one more pass over the gradient (36 us per layer at stage
A's shapes in the eighteenth lease's trace).

Registration: `track_1_short::qk_norm_rope` (forward: q, k and the row scales r) and
`track_1_short::qk_norm_rope_bwd` (q's and k's gradients -> qk's), torch.library custom ops with
fake kernels and autograd, so torch.compile(fullgraph) keeps them as two calls (one launch each,
q and k in one grid) and CUDA graphs capture them (no host sync, the grid depends on shapes only).
Only qk gets a gradient (the tables are buffers).

CPU: the kernels run on CPU tensors only under TRITON_INTERPRET=1 set before triton is imported
(tests/qk_norm_rope_cases.py through tests/test_qk_norm_rope.py); otherwise a CPU call is a
ValueError. Installed by trainer/build.py where TrainConfig.qk_norm_rope = "triton" (default
"torch": on the H200 the kernel took the stage-C step to 0.969x, but against a torch path that
had regressed since; docs/results/README.md, eighteenth lease).

Legend: T tokens, H heads, D head_dim, P table rows, R = T*H head rows per output, G head rows
per output position (H, paired H/2), BP positions per program, GP = G padded to a power of two.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from track_1_short.kernels.device import require_cuda_or_interpreter

ROW_SLOTS = 32  # head rows per program (padded: BLOCK_POS positions x GROUP_PAD rows each)
NUM_WARPS = 4


@triton.jit
def _sources(n, g, which, NUM_HEADS: tl.constexpr, PAIRED: tl.constexpr):
    """Positions n [BP] and members g [GP] of q (which 0) or k (1) -> their input rows of
    [T, 2, H, D], [BP, GP] int64. Output row n * G + g: unpaired head g of token n; paired head
    2g + n % 2 of token n // 2 (attention.pair_heads' row (n, g))."""
    if PAIRED:
        t = (n // 2)[:, None]
        h = 2 * g[None, :] + (n % 2)[:, None]
    else:
        t = n[:, None]
        h = g[None, :]
    return (t.to(tl.int64) * 2 + which) * NUM_HEADS + h


@triton.jit
def _table(cos_ptr, sin_ptr, n, pmask, dtype, D: tl.constexpr, BLOCK_POS: tl.constexpr):
    """The table row of each position n [BP], one value per pair (c[2i] = c[2i+1]), rounded to the
    activations' dtype as Yarn.rotate does: c, s [BP, 1, D/2] float32, shared by the position's
    head rows (loaded once per position, not once per head row)."""
    tab = n.to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :]
    c = tl.load(cos_ptr + tab, mask=pmask[:, None], other=0.0).to(dtype).to(tl.float32)
    s = tl.load(sin_ptr + tab, mask=pmask[:, None], other=0.0).to(dtype).to(tl.float32)
    c, _ = tl.split(tl.reshape(c, (BLOCK_POS, D // 2, 2)))
    s, _ = tl.split(tl.reshape(s, (BLOCK_POS, D // 2, 2)))
    return c[:, None, :], s[:, None, :]


@triton.jit
def _pick(which, q_ptr, k_ptr):
    """q's tensor (which 0) or k's (1)."""
    if which == 0:
        ptr = q_ptr
    else:
        ptr = k_ptr
    return ptr


@triton.jit
def _block(n_pos, which, NUM_HEADS: tl.constexpr, D: tl.constexpr, PAIRED: tl.constexpr,
           GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_POS: tl.constexpr):
    """This program's positions n [BP] (row groups of the outputs), their mask, the input rows
    src [BP, GP], output rows dst [BP, GP], the row mask [BP, GP] and the [BP, GP, D] element
    offsets of the input and the outputs."""
    n = tl.program_id(0) * BLOCK_POS + tl.arange(0, BLOCK_POS)  # [BP]
    g = tl.arange(0, GROUP_PAD)  # [GP]; members >= GROUP are padding
    pmask = n < n_pos
    rmask = pmask[:, None] & (g < GROUP)[None, :]  # [BP, GP]
    src = _sources(n, g, which, NUM_HEADS, PAIRED)
    dst = n.to(tl.int64)[:, None] * GROUP + g[None, :]
    cols = tl.arange(0, D)[None, None, :]
    return n, pmask, src, rmask, src[:, :, None] * D + cols, dst[:, :, None] * D + cols


@triton.jit
def _fwd(qk_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, rstd_ptr, n_pos, eps,
         NUM_HEADS: tl.constexpr, D: tl.constexpr, PAIRED: tl.constexpr, GROUP: tl.constexpr,
         GROUP_PAD: tl.constexpr, BLOCK_POS: tl.constexpr):
    which = tl.program_id(1)  # 0: q, 1: k
    n, pmask, src, rmask, x_off, o_off = _block(n_pos, which, NUM_HEADS, D, PAIRED, GROUP,
                                                GROUP_PAD, BLOCK_POS)
    mask = rmask[:, :, None]
    dtype = qk_ptr.dtype.element_ty
    x = tl.load(qk_ptr + x_off, mask=mask, other=0.0).to(tl.float32)  # [BP, GP, D]
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=2) / D + eps)  # [BP, GP]
    c, s = _table(cos_ptr, sin_ptr, n, pmask, dtype, D, BLOCK_POS)  # [BP, 1, D/2]
    # each pair (a, b) -> (ac - bs, bc + as)
    a, b = tl.split(tl.reshape(x, (BLOCK_POS, GROUP_PAD, D // 2, 2)))
    out = tl.reshape(tl.join(a * c - b * s, b * c + a * s), (BLOCK_POS, GROUP_PAD, D))
    tl.store(_pick(which, q_ptr, k_ptr) + o_off, (out * rstd[:, :, None]).to(dtype), mask=mask)
    tl.store(rstd_ptr + src, rstd, mask=rmask)


@triton.jit
def _bwd(gq_ptr, gk_ptr, qk_ptr, cos_ptr, sin_ptr, rstd_ptr, dqk_ptr, n_pos,
         NUM_HEADS: tl.constexpr, D: tl.constexpr, PAIRED: tl.constexpr, GROUP: tl.constexpr,
         GROUP_PAD: tl.constexpr, BLOCK_POS: tl.constexpr):
    which = tl.program_id(1)
    n, pmask, src, rmask, x_off, g_off = _block(n_pos, which, NUM_HEADS, D, PAIRED, GROUP,
                                                GROUP_PAD, BLOCK_POS)
    mask = rmask[:, :, None]
    dtype = qk_ptr.dtype.element_ty
    g = tl.load(_pick(which, gq_ptr, gk_ptr) + g_off, mask=mask, other=0.0).to(tl.float32)
    c, s = _table(cos_ptr, sin_ptr, n, pmask, dtype, D, BLOCK_POS)
    ga, gb = tl.split(tl.reshape(g, (BLOCK_POS, GROUP_PAD, D // 2, 2)))  # the rotation's transpose
    dy = tl.reshape(tl.join(ga * c + gb * s, gb * c - ga * s), (BLOCK_POS, GROUP_PAD, D))
    rstd = tl.load(rstd_ptr + src, mask=rmask, other=0.0)[:, :, None]
    y = tl.load(qk_ptr + x_off, mask=mask, other=0.0).to(tl.float32) * rstd
    dx = rstd * (dy - y * (tl.sum(dy * y, axis=2) / D)[:, :, None])
    tl.store(dqk_ptr + x_off, dx.to(dtype), mask=mask)


def interpreted() -> bool:
    """Whether the kernels run in the Triton interpreter (the only way CPU tensors can run them)."""
    return isinstance(_fwd, InterpretedFunction)


def _check(qk: Tensor, cos: Tensor, paired: bool) -> None:
    """ValueError naming what the kernels cannot take."""
    require_cuda_or_interpreter(qk.device, _fwd, "qk_norm_rope",
                                "the reference is TrainConfig.qk_norm_rope='torch'")
    if qk.dim() != 4 or qk.shape[1] != 2 or not qk.is_contiguous():
        raise ValueError(f"qk_norm_rope: qk must be a contiguous [T, 2, H, D] tensor, got "
                         f"{tuple(qk.shape)}")
    h, d = qk.shape[2:]
    if d < 2 or d & (d - 1):
        raise ValueError(f"qk_norm_rope: head_dim={d} must be a power of two")
    if paired and h % 2:
        raise ValueError(f"qk_norm_rope: paired heads need an even head count, got {h}")
    rows = 2 * qk.shape[0] if paired else qk.shape[0]
    if cos.dim() != 2 or cos.shape[1] != d or cos.shape[0] < rows or cos.dtype != torch.float32:
        raise ValueError(f"qk_norm_rope: the table must be float32 [>= {rows}, {d}], got "
                         f"{cos.dtype} {tuple(cos.shape)}")


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Launch shape of both kernels: about `row_slots` head rows per program (BLOCK_POS =
    row_slots // GROUP_PAD positions of GROUP_PAD rows each, at least one) on `num_warps` warps."""
    row_slots: int = ROW_SLOTS
    num_warps: int = NUM_WARPS

    def __post_init__(self):
        for name in ("row_slots", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"qk_norm_rope Tiling.{name}={v} must be a power of two >= 1")


def _launch(qk: Tensor, paired: bool, tiling: Tiling):
    """(positions, grid, meta) of either kernel: one program per BLOCK_POS output positions (row
    groups of G = H, or H/2 paired, head rows), of q and of k."""
    t, _, h, d = qk.shape
    group = h // 2 if paired else h
    n_pos = 2 * t if paired else t
    pad = triton.next_power_of_2(group)
    block = max(1, tiling.row_slots // pad)
    return n_pos, (triton.cdiv(n_pos, block), 2), dict(
        NUM_HEADS=h, D=d, PAIRED=paired, GROUP=group, GROUP_PAD=pad, BLOCK_POS=block,
        num_warps=tiling.num_warps)


def forward_into(qk: Tensor, cos: Tensor, sin: Tensor, paired: bool, q: Tensor, k: Tensor,
                 rstd: Tensor, tiling: Tiling = Tiling()) -> None:
    """The forward kernel writing q, k [R, D] and rstd [T * 2 * H] (the op's outputs, allocated
    by the caller; bench/qk_norm_rope.py times tilings through it)."""
    n_pos, grid, meta = _launch(qk, paired, tiling)
    eps = torch.finfo(torch.float32).eps  # F.rms_norm's default: its float32 opmath's epsilon
    _fwd[grid](qk, cos, sin, q, k, rstd, n_pos, eps, **meta)


def backward_into(gq: Tensor, gk: Tensor, qk: Tensor, cos: Tensor, sin: Tensor, rstd: Tensor,
                  paired: bool, dqk: Tensor, tiling: Tiling = Tiling()) -> None:
    """The backward kernel writing qk's gradient into dqk [T, 2, H, D] (gq, gk contiguous)."""
    n_pos, grid, meta = _launch(qk, paired, tiling)
    _bwd[grid](gq, gk, qk, cos, sin, rstd, dqk, n_pos, **meta)


@torch.library.custom_op("track_1_short::qk_norm_rope", mutates_args=())
def _qk_norm_rope(qk: Tensor, cos: Tensor, sin: Tensor,
                  paired: bool) -> tuple[Tensor, Tensor, Tensor]:
    _check(qk, cos, paired)
    q, k, rstd = _qk_norm_rope_fake(qk, cos, sin, paired)  # [R, D] each; [T * 2 * H] per input row
    forward_into(qk, cos, sin, paired, q, k, rstd)
    return q, k, rstd


@_qk_norm_rope.register_fake
def _qk_norm_rope_fake(qk, cos, sin, paired):
    t, _, h, d = qk.shape
    return (qk.new_empty(t * h, d), qk.new_empty(t * h, d),
            qk.new_empty(t * 2 * h, dtype=torch.float32))


@torch.library.custom_op("track_1_short::qk_norm_rope_bwd", mutates_args=())
def _qk_norm_rope_bwd(gq: Tensor, gk: Tensor, qk: Tensor, cos: Tensor, sin: Tensor, rstd: Tensor,
                      paired: bool) -> Tensor:
    dqk = torch.empty_like(qk)
    backward_into(gq.contiguous(), gk.contiguous(), qk, cos, sin, rstd, paired, dqk)
    return dqk


@_qk_norm_rope_bwd.register_fake
def _(gq, gk, qk, cos, sin, rstd, paired):
    return torch.empty_like(qk)


def _setup_context(ctx, inputs, output):
    qk, cos, sin, paired = inputs
    ctx.save_for_backward(qk, cos, sin, output[2])
    ctx.paired = paired


def _backward(ctx, gq: Tensor | None, gk: Tensor | None, _g_rstd: Tensor | None):
    qk, cos, sin, rstd = ctx.saved_tensors
    t, _, h, d = qk.shape
    # an output that reached no loss has no gradient: zeros, as autograd would have passed
    gq, gk = (qk.new_zeros(t * h, d) if g is None else g for g in (gq, gk))
    return _qk_norm_rope_bwd(gq, gk, qk, cos, sin, rstd, ctx.paired), None, None, None


_qk_norm_rope.register_autograd(_backward, setup_context=_setup_context)


def qk_norm_rope(qk: Tensor, cos: Tensor, sin: Tensor, paired: bool) -> tuple[Tensor, Tensor]:
    """qk [T, 2, H, D] (contiguous: the qk projection viewed) -> q, k normalised and rotated, each
    [T, H, D] or, paired, [2T, H/2, D] (attention.pair_heads' layout). cos, sin: the Yarn table,
    float32 [rows, D] (Yarn.head_tables(): a paired table viewed [2P, D]). The module docstring's math; the
    model's torch path (model/gpt.norm_rotate) is the reference."""
    t, _, h, d = qk.shape
    q, k, _ = _qk_norm_rope(qk, cos, sin, paired)  # [R, D] each
    shape = (2 * t, h // 2, d) if paired else (t, h, d)
    return q.view(shape), k.view(shape)
