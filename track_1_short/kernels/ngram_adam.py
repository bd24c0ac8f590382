"""The n-gram table's update event as one Triton kernel: lazy (sparse) Adam on every touched row
of a dense gradient accumulator, which it zeroes behind itself. No host sync, no data-dependent
shape: the kernel reads the touched flags and the Adam step count on the device.

What it replaces: NgramStore's reference event (perf/ngram_store.py `_event_reference`, the slow
path kept for the CPU, for W > 1 and for the parity tests): `touched.nonzero()` (a host sync),
gathers of the touched rows' gradient, moments and table rows, torch.optim.SparseAdam's formula,
scatters back, and zeroing the accumulator rows. That path runs ~10 separate passes over the
touched rows and syncs the host once for the row list and once for the step count.

Math (per touched row r, equal to the reference up to float32 rounding; t = step[0] after the
event's increment, lr = NgramConfig.lr x the step's lr multiplier):
    g = acc[r]                             (sum of the held micro-steps' sink gradients)
    m[r] = beta1 m[r] + (1 - beta1) g      v[r] = beta2 v[r] + (1 - beta2) g^2
    step_size = lr sqrt(1 - beta2^t) / (1 - beta1^t)
    u = m[r] / (sqrt(v[r]) + eps) * step_size            (eps before bias correction: SparseAdam)
    table[r] -= u + (u * table[r] > 0) * eff_wd * table[r]   (cautious decay; eff_wd = lr^2 wd)
    acc[r] = 0, touched[r] = 0
Rows with touched[r] == 0 keep their moments (lazy Adam: only rows in the gradient move). The
kernel's masked loads and stores skip them, so an untouched row costs one 4-byte flag read.
`dense=True` (NgramConfig.update "dense"): every row, g = 0 where untouched (dense Adam: a row's
momentum keeps moving it after its last touch; a row never touched has m = v = 0 and stays
bit-equal), at the cost of reading and writing the whole table and state.

Cost at stage C on one GPU (16 held micro-steps, ~480k touched of 754,560 rows, R = 768, float32):
per touched row read acc, m, v, table and write all four plus the zeroed acc: ~28 KB, ~13 GB per
event; the floor at ~4 TB/s is ~3.3 ms. Measured on one H200 (docs/results/README.md, 2026-12-01,
fifth lease): 3.06 ms per event in the real stage-C step (bench/step.py), 3.86 ms with 70.5% of
the rows touched in tests/test_ngram_adam_gpu.py (the reference path: 19.19 ms); it was 28.3 ms
before (unique, cat, eager SparseAdam, two host syncs and a cache refresh).

What must stay stable: nothing is owned here; every buffer is the caller's and is updated in
place (capture-safe: no allocation, no host read). Compiles once per (dtypes, R) at the first call.

CPU: like kernels/softcap_ce.py, the kernel runs on CPU tensors only in the Triton interpreter
(TRITON_INTERPRET=1 set before triton is imported); tests/ngram_adam_cases.py runs that way in its
own process (through tests/test_ngram_adam.py). Otherwise a CPU call is a ValueError.

Legend: N table rows (this rank's), R row width, BR rows per program.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from track_1_short.kernels.device import require_cuda_or_interpreter

ROWS_PER_PROGRAM = 4  # BR: rows of one program (a [BR, next_pow2(R)] tile)


@triton.jit
def _sparse_adam_rows(table_ptr, m_ptr, v_ptr, acc_ptr, touched_ptr, step_ptr, num_rows, row_width,
                      lr, beta1, beta2, log2_beta1, log2_beta2, eps, eff_wd,
                      BR: tl.constexpr, BLOCK_R: tl.constexpr, DENSE: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BR + tl.arange(0, BR)  # [BR]
    in_range = rows < num_rows
    flags = tl.load(touched_ptr + rows, mask=in_range, other=0)  # [BR]
    cols = tl.arange(0, BLOCK_R)  # [BLOCK_R]
    rows_ok = in_range if DENSE else (flags != 0) & in_range  # [BR]
    mask = rows_ok[:, None] & (cols < row_width)[None, :]  # [BR, BLOCK_R]
    offs = rows.to(tl.int64)[:, None] * row_width + cols[None, :]
    t = tl.load(step_ptr).to(tl.float32)
    step_size = lr * tl.sqrt(1.0 - tl.exp2(t * log2_beta2)) / (1.0 - tl.exp2(t * log2_beta1))
    g = tl.load(acc_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0) * beta1 + g * (1.0 - beta1)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0) * beta2 + g * g * (1.0 - beta2)
    p = tl.load(table_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = m / (tl.sqrt(v) + eps) * step_size
    p = p - u - tl.where(u * p > 0, p * eff_wd, 0.0)
    tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)
    tl.store(table_ptr + offs, p.to(table_ptr.dtype.element_ty), mask=mask)
    tl.store(acc_ptr + offs, tl.zeros_like(g).to(acc_ptr.dtype.element_ty), mask=mask)
    tl.store(touched_ptr + rows, tl.zeros_like(flags), mask=in_range)


def interpreted() -> bool:
    """Whether the kernel runs in the Triton interpreter (the only way CPU tensors can run it)."""
    return isinstance(_sparse_adam_rows, InterpretedFunction)


def _check(table: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, acc: Tensor, touched: Tensor,
           step: Tensor) -> None:
    """ValueError naming the argument the kernel cannot take."""
    where = "sparse_adam_rows"
    require_cuda_or_interpreter(table.device, _sparse_adam_rows, where, "the CPU path is the reference")
    for name, t in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("acc", acc)):
        if t.shape != table.shape or not t.is_contiguous():
            raise ValueError(f"{where}: {name} {tuple(t.shape)} must be contiguous and shaped like "
                             f"the table {tuple(table.shape)}")
    if table.dim() != 2 or not table.is_contiguous():
        raise ValueError(f"{where}: table must be a contiguous [N, R] tensor, got {tuple(table.shape)}")
    if touched.shape != table.shape[:1] or touched.dtype != torch.int32:
        raise ValueError(f"{where}: touched must be int32 [{table.shape[0]}], got "
                         f"{touched.dtype} {tuple(touched.shape)}")
    if exp_avg.dtype != torch.float32 or exp_avg_sq.dtype != torch.float32 or acc.dtype != torch.float32:
        raise ValueError(f"{where}: exp_avg, exp_avg_sq and acc must be float32, got {exp_avg.dtype}, "
                         f"{exp_avg_sq.dtype}, {acc.dtype}; NgramConfig.dtype float64 runs the "
                         f"reference (NgramStore.event_kernel = None)")
    if step.numel() != 1:
        raise ValueError(f"{where}: step must be a one-element tensor, got {tuple(step.shape)}")


def sparse_adam_rows(table: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, acc: Tensor,
                     touched: Tensor, step: Tensor, *, lr: float, beta1: float, beta2: float,
                     eps: float, eff_wd: float = 0.0, dense: bool = False) -> None:
    """In place: Adam (module docstring) on every row r of `table` [N, R] with touched[r] != 0
    (every row with dense=True), reading its gradient from acc [N, R] and the step count from
    `step` (device, 0-d), with cautious decay eff_wd (lr^2 x weight decay; 0: none); acc and
    touched rows are zeroed. exp_avg, exp_avg_sq, acc: float32 [N, R]; table float32 or bf16."""
    _check(table, exp_avg, exp_avg_sq, acc, touched, step)
    num_rows, width = table.shape
    grid = (triton.cdiv(num_rows, ROWS_PER_PROGRAM),)
    _sparse_adam_rows[grid](table, exp_avg, exp_avg_sq, acc, touched, step, num_rows, width,
                            float(lr), float(beta1), float(beta2), math.log2(beta1),
                            math.log2(beta2), float(eps), float(eff_wd), BR=ROWS_PER_PROGRAM,
                            BLOCK_R=triton.next_power_of_2(width), DENSE=bool(dense), num_warps=8)
