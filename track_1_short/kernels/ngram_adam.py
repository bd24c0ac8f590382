"""The n-gram table's update event in Triton: lazy (sparse) Adam on every touched row of a dense
gradient accumulator, which it zeroes behind itself. No host sync, no data-dependent shape: the
kernels read the touched flags, the listed rows' count and the Adam step count on the device.

Lazy event, two kernels: `_list_touched` (one program per BF flags) appends the touched rows to
the caller's fixed-capacity `row_list` [N] (each program reserves its slots with one atomic add on
`row_count`, so the list's order across programs is arbitrary; every row's update is independent,
so the result is not) and clears their flags; `_adam_listed_rows`, a persistent grid (SMs x
PROGRAMS_PER_SM programs, each looping over tiles of BR listed rows), runs the math below on the
listed rows only. Dense event (`dense=True`): `_adam_all_rows`, one program per BR rows of the
table. All three share `_adam_tile` (the row math) and `_step_size`.

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
Rows with touched[r] == 0 keep their moments (lazy Adam: only rows in the gradient move); an
untouched row costs one 4-byte flag read in the listing pass.
`dense=True` (NgramConfig.update "dense"): every row, g = 0 where untouched (dense Adam: a row's
momentum keeps moving it after its last touch; a row never touched has m = v = 0 and stays
bit-equal), at the cost of reading and writing the whole table and state.

Cost: per touched row read acc, m, v, table and write m, v, table and the zeroed acc (~24.6 KB
at R = 768, float32). Measured on one H100 (docs/results/ngram_event_tied_2026-12-07/, bench/ngram_event.py,
same process): stage A's event (2 held micro-steps of 16,384 tokens, 41k of 754,560 rows touched)
0.53 ms, against 1.31 ms for the one-kernel form this replaced (one program per 4 rows over the
whole table, most with nothing to do) and 2.53 ms for the reference; with 394k rows touched (stage
C, 16 held) 3.59 ms against 3.71 ms (2.7 TB/s, near the card's bandwidth). Before the one-kernel form
the event took 28.3 ms at stage C on the H200 (unique, cat, eager SparseAdam, two host syncs).

What must stay stable: nothing is owned here; every buffer is the caller's and is updated in
place (capture-safe: no allocation, no host read; NgramStore owns the scratch, `event_rows` and
`event_count`). Compiles once per (dtypes, R) at the first call.

CPU: like kernels/softcap_ce.py, the kernel runs on CPU tensors only in the Triton interpreter
(TRITON_INTERPRET=1 set before triton is imported); tests/ngram_adam_cases.py runs that way in its
own process (through tests/test_ngram_adam.py). Otherwise a CPU call is a ValueError.

Legend: N table rows (this rank's), R row width, BR rows per tile, BF flags per listing program.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from track_1_short.kernels.device import require_cuda_or_interpreter

ROWS_PER_PROGRAM = 4  # BR: rows of one tile ([BR, next_pow2(R)]) of the Adam kernels
FLAGS_PER_PROGRAM = 1024  # BF: touched flags one program of the listing kernel scans
PROGRAMS_PER_SM = 4  # the lazy Adam kernel's persistent grid on CUDA: SMs x this
INTERPRETED_PROGRAMS = 3  # ... and in the interpreter (small, so each program loops over tiles)
INTERPRETED_FLAGS = 16  # BF in the interpreter (small, so the CPU tables need several programs)


@triton.jit
def _adam_tile(table_ptr, m_ptr, v_ptr, acc_ptr, rows, rows_ok, row_width, step_size, beta1,
               beta2, eps, eff_wd, BLOCK_R: tl.constexpr):
    """The module docstring's math on the rows `rows` [BR] where rows_ok, then their acc zeroed."""
    cols = tl.arange(0, BLOCK_R)  # [BLOCK_R]
    mask = rows_ok[:, None] & (cols < row_width)[None, :]  # [BR, BLOCK_R]
    offs = rows.to(tl.int64)[:, None] * row_width + cols[None, :]
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


@triton.jit
def _step_size(step_ptr, lr, log2_beta1, log2_beta2):
    """lr sqrt(1 - beta2^t) / (1 - beta1^t), t read on the device (fp32 scalar)."""
    t = tl.load(step_ptr).to(tl.float32)
    return lr * tl.sqrt(1.0 - tl.exp2(t * log2_beta2)) / (1.0 - tl.exp2(t * log2_beta1))


@triton.jit
def _list_touched(touched_ptr, row_list_ptr, row_count_ptr, num_rows, BF: tl.constexpr):
    """Lazy event, pass 1: append the touched rows of this program's BF flags to row_list
    (ascending within the program; programs reserve their slots with one atomic on row_count, so
    the list's order across programs is arbitrary) and clear their flags."""
    rows = tl.program_id(0) * BF + tl.arange(0, BF)  # [BF]
    in_range = rows < num_rows
    flags = tl.load(touched_ptr + rows, mask=in_range, other=0)  # [BF]
    hit = (flags != 0) & in_range
    n = tl.sum(hit.to(tl.int32), axis=0)
    base = tl.atomic_add(row_count_ptr, n)  # this program's first slot
    slot = base + tl.cumsum(hit.to(tl.int32), axis=0) - 1  # [BF]
    tl.store(row_list_ptr + slot, rows, mask=hit)
    tl.store(touched_ptr + rows, tl.zeros_like(flags), mask=hit)


@triton.jit
def _adam_listed_rows(table_ptr, m_ptr, v_ptr, acc_ptr, row_list_ptr, row_count_ptr, step_ptr,
                      row_width, lr, beta1, beta2, log2_beta1, log2_beta2, eps, eff_wd,
                      BR: tl.constexpr, BLOCK_R: tl.constexpr):
    """Lazy event, pass 2 (a persistent grid): tiles of BR listed rows, program p taking tiles
    p, p + P, p + 2P, ... of the row_count[0] listed ones."""
    step_size = _step_size(step_ptr, lr, log2_beta1, log2_beta2)
    count = tl.load(row_count_ptr)
    stride = tl.num_programs(0) * BR
    first = tl.program_id(0) * BR
    # a while loop, not range(first, count, stride): the interpreter (numpy 2) cannot index a
    # range by a loaded or program-id scalar
    while first < count:
        idx = first + tl.arange(0, BR)  # [BR] positions in the list
        listed = idx < count
        rows = tl.load(row_list_ptr + idx, mask=listed, other=0)  # [BR]
        _adam_tile(table_ptr, m_ptr, v_ptr, acc_ptr, rows, listed, row_width, step_size, beta1,
                   beta2, eps, eff_wd, BLOCK_R)
        first += stride


@triton.jit
def _adam_all_rows(table_ptr, m_ptr, v_ptr, acc_ptr, touched_ptr, step_ptr, num_rows, row_width,
                   lr, beta1, beta2, log2_beta1, log2_beta2, eps, eff_wd,
                   BR: tl.constexpr, BLOCK_R: tl.constexpr):
    """Dense event: every row (g = acc, zero where untouched), one tile per program; flags cleared."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)  # [BR]
    in_range = rows < num_rows
    step_size = _step_size(step_ptr, lr, log2_beta1, log2_beta2)
    _adam_tile(table_ptr, m_ptr, v_ptr, acc_ptr, rows, in_range, row_width, step_size, beta1,
               beta2, eps, eff_wd, BLOCK_R)
    tl.store(touched_ptr + rows, tl.zeros((BR,), dtype=tl.int32), mask=in_range)


def interpreted() -> bool:
    """Whether the kernels run in the Triton interpreter (the only way CPU tensors can run them)."""
    return isinstance(_adam_listed_rows, InterpretedFunction)


def _check(table: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, acc: Tensor, touched: Tensor,
           step: Tensor, row_list: Tensor, row_count: Tensor) -> None:
    """ValueError naming the argument the kernels cannot take."""
    where = "sparse_adam_rows"
    require_cuda_or_interpreter(table.device, _adam_listed_rows, where, "the CPU path is the reference")
    for name, t in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("acc", acc)):
        if t.shape != table.shape or not t.is_contiguous():
            raise ValueError(f"{where}: {name} {tuple(t.shape)} must be contiguous and shaped like "
                             f"the table {tuple(table.shape)}")
    if table.dim() != 2 or not table.is_contiguous():
        raise ValueError(f"{where}: table must be a contiguous [N, R] tensor, got {tuple(table.shape)}")
    for name, t, shape in (("touched", touched, table.shape[:1]), ("row_list", row_list, table.shape[:1]),
                           ("row_count", row_count, (1,))):
        if t.shape != shape or t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(f"{where}: {name} must be a contiguous int32 [{shape[0]}], got "
                             f"{t.dtype} {tuple(t.shape)}")
    if exp_avg.dtype != torch.float32 or exp_avg_sq.dtype != torch.float32 or acc.dtype != torch.float32:
        raise ValueError(f"{where}: exp_avg, exp_avg_sq and acc must be float32, got {exp_avg.dtype}, "
                         f"{exp_avg_sq.dtype}, {acc.dtype}; NgramConfig.dtype float64 runs the "
                         f"reference (NgramStore.event_kernel = None)")
    if step.numel() != 1:
        raise ValueError(f"{where}: step must be a one-element tensor, got {tuple(step.shape)}")


def _grids(device: torch.device, num_rows: int) -> tuple[int, int, int]:
    """(BF, listing programs, persistent Adam programs) on `device`."""
    if device.type != "cuda":
        return INTERPRETED_FLAGS, triton.cdiv(num_rows, INTERPRETED_FLAGS), INTERPRETED_PROGRAMS
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return FLAGS_PER_PROGRAM, triton.cdiv(num_rows, FLAGS_PER_PROGRAM), sms * PROGRAMS_PER_SM


def sparse_adam_rows(table: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, acc: Tensor,
                     touched: Tensor, step: Tensor, row_list: Tensor, row_count: Tensor, *,
                     lr: float, beta1: float, beta2: float, eps: float, eff_wd: float = 0.0,
                     dense: bool = False) -> None:
    """In place: Adam (module docstring) on every row r of `table` [N, R] with touched[r] != 0
    (every row with dense=True), reading its gradient from acc [N, R] and the step count from
    `step` (device, 0-d), with cautious decay eff_wd (lr^2 x weight decay; 0: none); acc and
    touched rows are zeroed. exp_avg, exp_avg_sq, acc: float32 [N, R]; table float32 or bf16.
    row_list int32 [N] and row_count int32 [1]: the caller's scratch of the lazy event (the listed
    rows and their count, overwritten; the dense event leaves them alone)."""
    _check(table, exp_avg, exp_avg_sq, acc, touched, step, row_list, row_count)
    num_rows, width = table.shape
    scalars = (float(lr), float(beta1), float(beta2), math.log2(beta1), math.log2(beta2),
               float(eps), float(eff_wd))
    block_r = triton.next_power_of_2(width)
    if dense:
        grid = (triton.cdiv(num_rows, ROWS_PER_PROGRAM),)
        _adam_all_rows[grid](table, exp_avg, exp_avg_sq, acc, touched, step, num_rows, width,
                             *scalars, BR=ROWS_PER_PROGRAM, BLOCK_R=block_r, num_warps=8)
        return
    flags, listing, persistent = _grids(table.device, num_rows)
    row_count.zero_()
    _list_touched[(listing,)](touched, row_list, row_count, num_rows, BF=flags, num_warps=4)
    _adam_listed_rows[(persistent,)](
        table, exp_avg, exp_avg_sq, acc, row_list, row_count, step, width, *scalars,
        BR=ROWS_PER_PROGRAM, BLOCK_R=block_r, num_warps=8)
