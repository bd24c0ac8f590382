"""The n-gram hold's row accumulation, acc[ids[j]] += grad[j] for every j, as
`acc.index_add_(0, ids, grad)` computes it (the reference, one scalar float32 atomic per
element), by one of two Triton kernels:

- `row_accumulate_vector_` (TrainConfig.ngram_accumulate="vector_atomic"): the same atomic sum,
  four columns per atomic instruction. On SM90 Triton 3.6 lowers a tile's `tl.atomic_add` of
  float32 to `atom.global.gpu.relaxed.add.v4.f32` where it can prove 16-byte alignment and a
  mask constant over each group of four: the accumulator's row width a multiple of 4 (a
  constexpr here), the pointers 16-byte aligned (Triton's launch specialisation), the column
  block a multiple of 4. Checked by compiling the kernel to PTX for sm_90 on the CPU (768
  columns: v4; 7 or 259: scalar). A width that is not a multiple of 4 still sums correctly
  with scalar atomics. Not deterministic (atomics add in no fixed order), like the reference.
  Cost: read N x R x 4 bytes of gradient, N x R / 4 vector atomics into the accumulator.
  Measured on one H200 (docs/results/ngram_vector_atomic_h200_2026-12-03/, bench/ngram_hold.py
  on real tokens): 0.239 ms against index_add_'s 0.541 at C (1.6x a copy of the gradient), 0.084
  against 0.185 at A; in the stage-C step the kernel time fell by 3.35 ms per step. The default
  on CUDA (TrainConfig.ngram_accumulate="auto").
- `row_accumulate_` (TrainConfig.ngram_accumulate="sorted"): without atomics, deterministic: a
  stable sort of the ids and one program per run of equal ids that sums the run's gradient rows
  and adds the sum into its accumulator row once.

Why the sorted kernel exists: the sum is deterministic (a run is summed in the stable sort's
order, the ids' own order); index_add_'s float32 atomics add in no fixed order, so a run with
the default differs from itself in the last bits. The two agree within float32 rounding, not
bitwise. It was built to be faster than index_add_ (predicted ~0.2-0.25 ms against 0.58 per
stage-C micro-step: one read of each gradient row, one read and write of each distinct
accumulator row, no atomics) and is not: measured on one H200
(docs/results/row_accumulate_h200_2026-12-03/, bench/ngram_hold.py on real tokens) 0.839 ms
against index_add_'s 0.523 at C (56,005 distinct of 98,304 ids) and 0.297 against 0.179 at A; in
the stage-C step 4.8 ms per step of this kernel plus ~0.5 of sort, against 4.6 of index_add_ in
the same step on another machine (docs/results/vs_record_h200_2026-12-03_lease15/call1).
Each run is summed by one program in a loop of dependent loads (the id's next position, then
its gradient row), which leaves the memory system idle; index_add_'s atomics were not the
bottleneck the prediction assumed (0.52 ms is ~3.7x a copy of the gradient, 0.143 ms). Hence
"sorted" is the deterministic option at that cost. (Its first notes said Triton emits only
scalar float32 atomics: that PTX was compiled without the alignment facts a launch gives.)
Cost: a sort of N int64 ids (torch.sort, stable) and one kernel: read N x R x 4 bytes of
gradient, read and write U x R x 4 bytes of accumulator.

Both: no host sync, no data-dependent shape (the grids depend on N and R only; the sorted
kernel's programs not at the start of a run return after two loads): capture-safe
(tests/test_row_accumulate_gpu.py captures and replays them).

CPU: like kernels/ngram_adam.py, the kernels run on CPU tensors only in the Triton interpreter
(TRITON_INTERPRET=1 set before triton is imported; tests/row_accumulate_cases.py, through
tests/test_row_accumulate.py). Otherwise a CPU call is a ValueError.

Legend: N ids (2T, or T without trigrams), R row width, U distinct ids, ROWS accumulator rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from track_1_short.kernels.device import require_cuda_or_interpreter

BLOCK_R = 256  # columns per program (R = 768: three programs per run or per row block)
VECTOR_BLOCK_N = 16  # gradient rows per program of the vector-atomic kernel


@triton.jit
def _run_sums(acc_ptr, grad_ptr, sorted_ptr, order_ptr, n, row_width, BLOCK_R: tl.constexpr):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    cmask = cols < row_width
    row = tl.load(sorted_ptr + i)
    prev = tl.load(sorted_ptr + i - 1, mask=i > 0, other=-1)
    if row != prev:  # the first position of a run of equal ids: this program sums the run
        total = tl.zeros([BLOCK_R], dtype=tl.float32)
        j = i
        nxt = row
        while nxt == row:
            src = tl.load(order_ptr + j).to(tl.int64)  # the run's j-th gradient row
            total += tl.load(grad_ptr + src * row_width + cols, mask=cmask, other=0.0)
            j += 1
            nxt = tl.load(sorted_ptr + j, mask=j < n, other=-1)
        dst = acc_ptr + row.to(tl.int64) * row_width + cols
        tl.store(dst, tl.load(dst, mask=cmask, other=0.0) + total, mask=cmask)


@triton.jit
def _vector_atomic_rows(acc_ptr, grad_ptr, ids_ptr, n, grad_stride, ROW_WIDTH: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] gradient rows
    rmask = rows < n
    ids = tl.load(ids_ptr + rows, mask=rmask, other=0).to(tl.int64)  # [BLOCK_N]
    cols = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    mask = rmask[:, None] & (cols < ROW_WIDTH)[None, :]  # [BLOCK_N, BLOCK_R]
    g = tl.load(grad_ptr + rows[:, None].to(tl.int64) * grad_stride + cols[None, :], mask=mask)
    # ROW_WIDTH a multiple of 4: four columns per atomic (module docstring)
    tl.atomic_add(acc_ptr + ids[:, None] * ROW_WIDTH + cols[None, :], g, mask=mask, sem="relaxed")


def interpreted() -> bool:
    """Whether the kernel runs in the Triton interpreter (the only way CPU tensors can run it)."""
    return isinstance(_run_sums, InterpretedFunction)


def _check(acc: Tensor, ids: Tensor, grad: Tensor, where: str) -> None:
    """ValueError naming the argument the kernel `where` cannot take."""
    require_cuda_or_interpreter(acc.device, _run_sums, where,
                                "the reference is acc.index_add_(0, ids, grad)")
    if acc.dim() != 2 or not acc.is_contiguous() or acc.dtype != torch.float32:
        raise ValueError(f"{where}: acc must be a contiguous float32 [ROWS, R] tensor, got "
                         f"{acc.dtype} {tuple(acc.shape)}")
    if grad.dim() != 2 or grad.shape[1] != acc.shape[1] or grad.dtype != torch.float32:
        raise ValueError(f"{where}: grad must be float32 [N, {acc.shape[1]}], got {grad.dtype} "
                         f"{tuple(grad.shape)}")
    if ids.dim() != 1 or ids.shape[0] != grad.shape[0] or ids.dtype != torch.int64:
        raise ValueError(f"{where}: ids must be int64 [{grad.shape[0]}] (one per gradient row), "
                         f"got {ids.dtype} {tuple(ids.shape)}")


def row_accumulate_(acc: Tensor, ids: Tensor, grad: Tensor) -> Tensor:
    """In place: acc[ids[j]] += grad[j] for every j (acc.index_add_(0, ids, grad), without
    atomics; module docstring). acc float32 [ROWS, R]; ids int64 [N], each in [0, ROWS) (not
    checked: a host read); grad float32 [N, R], any row stride. Returns acc."""
    _check(acc, ids, grad, "row_accumulate_")
    n, width = grad.shape
    if n == 0:
        return acc
    grad = grad.contiguous()
    ordered, order = torch.sort(ids, stable=True)  # [N] each
    grid = (n, triton.cdiv(width, BLOCK_R))
    _run_sums[grid](acc, grad, ordered, order, n, width, BLOCK_R=BLOCK_R, num_warps=2)
    return acc


def row_accumulate_vector_(acc: Tensor, ids: Tensor, grad: Tensor) -> Tensor:
    """In place: acc[ids[j]] += grad[j] for every j (acc.index_add_(0, ids, grad) with four
    columns per float32 atomic where R is a multiple of 4; module docstring). acc float32
    [ROWS, R]; ids int64 [N], each in [0, ROWS) (not checked: a host read); grad float32 [N, R]
    with unit column stride (any row stride; else copied). Returns acc."""
    _check(acc, ids, grad, "row_accumulate_vector_")
    n, width = grad.shape
    if n == 0:
        return acc
    if grad.stride(1) != 1:
        grad = grad.contiguous()
    grid = (triton.cdiv(n, VECTOR_BLOCK_N), triton.cdiv(width, BLOCK_R))
    _vector_atomic_rows[grid](acc, grad, ids.contiguous(), n, grad.stride(0), ROW_WIDTH=width,
                              BLOCK_N=VECTOR_BLOCK_N, BLOCK_R=BLOCK_R, num_warps=4)
    return acc
