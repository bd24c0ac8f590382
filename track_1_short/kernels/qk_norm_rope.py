"""q and k of one attention layer: per-head rms-norm, then the half-truncated interleaved RoPE
(model/yarn.py), written straight into the attention's layout, in one Triton pass forward and
one backward.

What it replaces (the reference, model/gpt.norm_rotate, which stays the definition):
`rms_norm(q), rms_norm(k)` over [T, H, D] views of the qk projection, then `Yarn.rotate` (or, on a
paired layer, `Yarn.rotate_doubled(pair_heads(.))`). Inductor compiles that into one or more
reductions that ran at ~2.5x their memory floor at stage C (one program of 64 threads per
(token, 3 heads); docs/LOG.md 2026-12-03, eighteenth session), three kernels plus copies on a
paired layer. Here each program normalises BLOCK_ROWS head rows of D columns and rotates them:
read the projection's [T, 2, H, D] once, write q and k once (a pair's two columns are split in
registers: tl.split of the row viewed [D/2, 2]). Each head row loads the rotating pairs of its
position's float32 table row: one value per pair (columns 2i, i < D/4), the stationary half (cos
1, sin 0 at every window) never read; L1 and L2 serve the repeats across a position's heads.
Alone on an H100, with the whole table row read (2 KB per 512 B of activations moved), the pair
moved the floor's bytes at 2.54 TB/s forward and 2.71 backward at stage A (76% and 81% of the
HBM3 peak), and a layout reading each table row once per position measured the same
(bench/qk_norm_rope.py, docs/results/qk_norm_rope_h100_2026-12-07/).

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

Legend: T tokens, H heads, D head_dim, P table rows, R = T*H head rows per output.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from track_1_short.kernels.device import require_cuda_or_interpreter

BLOCK_ROWS = 16  # head rows per program


@triton.jit
def _rows(o, which, NUM_HEADS: tl.constexpr, PAIRED: tl.constexpr):
    """Output row o of q (which 0) or k (1) -> its input row of [T, 2, H, D] and table position."""
    if PAIRED:
        n = o // (NUM_HEADS // 2)
        t = n // 2
        h = 2 * (o % (NUM_HEADS // 2)) + n % 2
        pos = n
    else:
        t = o // NUM_HEADS
        h = o % NUM_HEADS
        pos = t
    return ((t * 2 + which) * NUM_HEADS + h).to(tl.int64), pos


@triton.jit
def _table(cos_ptr, sin_ptr, pos, mask, dtype, D: tl.constexpr):
    """The table value of each pair at its row's position, rounded to the activations' dtype as
    Yarn.rotate does: c, s [BR, D/2] float32. Only the rotating pairs [0, D/4) are read (column
    2i of the table; c[2i] = c[2i+1]); the stationary pairs [D/4, D/2) take cos 1, sin 0, the
    values their columns hold at every window (model/yarn.py: frequency 0 stays 0)."""
    pairs = tl.arange(0, D // 2)
    rot = mask & (pairs < D // 4)[None, :]
    tab = pos.to(tl.int64)[:, None] * D + 2 * pairs[None, :]
    c = tl.load(cos_ptr + tab, mask=rot, other=1.0).to(dtype).to(tl.float32)
    s = tl.load(sin_ptr + tab, mask=rot, other=0.0).to(dtype).to(tl.float32)
    return c, s


@triton.jit
def _pick(which, q_ptr, k_ptr):
    """q's tensor (which 0) or k's (1)."""
    if which == 0:
        ptr = q_ptr
    else:
        ptr = k_ptr
    return ptr


@triton.jit
def _block(n_rows, which, NUM_HEADS: tl.constexpr, D: tl.constexpr, PAIRED: tl.constexpr,
           BLOCK_ROWS: tl.constexpr):
    """This program's rows of q (which 0) or k (1): their input rows src [BR] (of [T, 2, H, D];
    the row scales' index too), table positions pos [BR], the row mask [BR] and its [BR, D] broadcast, and the [BR, D] element
    offsets of the input rows (into [T, 2, H, D]) and of the output rows (into q's or k's [R, D])."""
    o = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # [BR] output rows
    rmask = o < n_rows
    src, pos = _rows(o, which, NUM_HEADS, PAIRED)
    cols = tl.arange(0, D)[None, :]
    return (src, pos, rmask, rmask[:, None], src[:, None] * D + cols,
            o.to(tl.int64)[:, None] * D + cols)


@triton.jit
def _fwd(qk_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, rstd_ptr, n_rows, eps,
         NUM_HEADS: tl.constexpr, D: tl.constexpr, PAIRED: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    which = tl.program_id(1)  # 0: q, 1: k
    src, pos, rmask, mask, x_off, o_off = _block(n_rows, which, NUM_HEADS, D, PAIRED, BLOCK_ROWS)
    dtype = qk_ptr.dtype.element_ty
    x = tl.load(qk_ptr + x_off, mask=mask, other=0.0).to(tl.float32)  # [BR, D]
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)  # [BR]
    c, s = _table(cos_ptr, sin_ptr, pos, mask, dtype, D)  # [BR, D/2]
    a, b = tl.split(tl.reshape(x, (BLOCK_ROWS, D // 2, 2)))  # each pair (a, b) -> (ac - bs, bc + as)
    out = tl.reshape(tl.join(a * c - b * s, b * c + a * s), (BLOCK_ROWS, D)) * rstd[:, None]
    tl.store(_pick(which, q_ptr, k_ptr) + o_off, out.to(dtype), mask=mask)
    tl.store(rstd_ptr + src, rstd, mask=rmask)


@triton.jit
def _bwd(gq_ptr, gk_ptr, qk_ptr, cos_ptr, sin_ptr, rstd_ptr, dqk_ptr, n_rows,
         NUM_HEADS: tl.constexpr, D: tl.constexpr, PAIRED: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    which = tl.program_id(1)
    src, pos, rmask, mask, x_off, g_off = _block(n_rows, which, NUM_HEADS, D, PAIRED, BLOCK_ROWS)
    dtype = qk_ptr.dtype.element_ty
    g = tl.load(_pick(which, gq_ptr, gk_ptr) + g_off, mask=mask, other=0.0).to(tl.float32)
    c, s = _table(cos_ptr, sin_ptr, pos, mask, dtype, D)
    ga, gb = tl.split(tl.reshape(g, (BLOCK_ROWS, D // 2, 2)))  # the rotation's transpose per pair
    dy = tl.reshape(tl.join(ga * c + gb * s, gb * c - ga * s), (BLOCK_ROWS, D))
    rstd = tl.load(rstd_ptr + src, mask=rmask, other=0.0)[:, None]
    y = tl.load(qk_ptr + x_off, mask=mask, other=0.0).to(tl.float32) * rstd
    dx = rstd * (dy - y * (tl.sum(dy * y, axis=1) / D)[:, None])
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
    if d < 4 or d & (d - 1):
        raise ValueError(f"qk_norm_rope: head_dim={d} must be a power of two >= 4 (a quarter of "
                         f"its columns are the rotating pairs)")
    if paired and h % 2:
        raise ValueError(f"qk_norm_rope: paired heads need an even head count, got {h}")
    rows = 2 * qk.shape[0] if paired else qk.shape[0]
    if cos.dim() != 2 or cos.shape[1] != d or cos.shape[0] < rows or cos.dtype != torch.float32:
        raise ValueError(f"qk_norm_rope: the table must be float32 [>= {rows}, {d}], got "
                         f"{cos.dtype} {tuple(cos.shape)}")


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Launch shape of both kernels: `block_rows` head rows per program on `num_warps` warps."""
    block_rows: int = BLOCK_ROWS
    num_warps: int = 4

    def __post_init__(self):
        for name in ("block_rows", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"qk_norm_rope Tiling.{name}={v} must be a power of two >= 1")


def _launch(qk: Tensor, paired: bool, tiling: Tiling):
    """(R, grid, meta) of either kernel: one program per block_rows output rows, of q and of k."""
    t, _, h, d = qk.shape
    n_rows = t * h
    return n_rows, (triton.cdiv(n_rows, tiling.block_rows), 2), dict(
        NUM_HEADS=h, D=d, PAIRED=paired, BLOCK_ROWS=tiling.block_rows, num_warps=tiling.num_warps)


def forward_into(qk: Tensor, cos: Tensor, sin: Tensor, paired: bool, q: Tensor, k: Tensor,
                 rstd: Tensor, tiling: Tiling = Tiling()) -> None:
    """The forward kernel writing q, k [R, D] and rstd [T * 2 * H] (the op's outputs, allocated
    by the caller; bench/qk_norm_rope.py times tilings through it)."""
    n_rows, grid, meta = _launch(qk, paired, tiling)
    eps = torch.finfo(torch.float32).eps  # F.rms_norm's default: its float32 opmath's epsilon
    _fwd[grid](qk, cos, sin, q, k, rstd, n_rows, eps, **meta)


def backward_into(gq: Tensor, gk: Tensor, qk: Tensor, cos: Tensor, sin: Tensor, rstd: Tensor,
                  paired: bool, dqk: Tensor, tiling: Tiling = Tiling()) -> None:
    """The backward kernel writing qk's gradient into dqk [T, 2, H, D] (gq, gk contiguous)."""
    n_rows, grid, meta = _launch(qk, paired, tiling)
    _bwd[grid](gq, gk, qk, cos, sin, rstd, dqk, n_rows, **meta)


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
