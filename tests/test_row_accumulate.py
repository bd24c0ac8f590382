"""The n-gram hold's atomic-free row accumulation (track_1_short/kernels/row_accumulate.py) on
the CPU.

Scope: the kernel cases (tests/row_accumulate_cases.py: against acc.index_add_ over runs of one
row, distinct rows, real n-gram row ids, strided gradients, input errors) run in a child pytest
process with TRITON_INTERPRET=1, which must be set before triton is imported and must not leak
into this process. Here, without the interpreter: a CPU call is a clear error, and the
vector-atomic kernel compiled for sm_90 (PTX, no GPU needed) adds four float32 columns per atomic
at the speedrun's row width (a scalar atomic per column at one that is not a multiple of 4).
Hardware: CPU (needs triton installed; skipped otherwise); ~20 s.
Run: `PYTHONPATH=. .venv/bin/python -m pytest tests/test_row_accumulate.py -q`.
"""

import pytest
import torch

pytest.importorskip("triton")

from tests.interpreter_cases import run_interpreter_cases  # noqa: E402
from tests.triton_ptx import global_accesses, sm90_ptx  # noqa: E402
from track_1_short.kernels import row_accumulate  # noqa: E402

NUM_CASES = 18  # tests in row_accumulate_cases.py (parametrizations included)


def test_kernel_cases_in_the_triton_interpreter():
    run_interpreter_cases("row_accumulate_cases.py", NUM_CASES)


def test_a_cpu_call_is_an_error():
    if row_accumulate.interpreted():
        pytest.skip("this process imported triton with TRITON_INTERPRET=1")
    with pytest.raises(ValueError, match="runs on CUDA"):
        row_accumulate.row_accumulate_(torch.zeros(4, 3), torch.zeros(2, dtype=torch.int64),
                                       torch.zeros(2, 3))


def _atomics_in_ptx(row_width: int) -> set[str]:
    """The atomic adds of _vector_atomic_rows compiled for sm_90 as a launch on 16-byte aligned
    tensors specialises it (pointers and the row stride divisible by 16)."""
    types = {"acc_ptr": "*fp32", "grad_ptr": "*fp32", "ids_ptr": "*i64", "n": "i32", "grad_stride": "i32"}
    aligned = ["acc_ptr", "grad_ptr", "ids_ptr"] + (["grad_stride"] if row_width % 16 == 0 else [])
    ptx = sm90_ptx(row_accumulate._vector_atomic_rows, types,
                   {"ROW_WIDTH": row_width, "BLOCK_N": row_accumulate.VECTOR_BLOCK_N,
                    "BLOCK_R": row_accumulate.BLOCK_R}, aligned)
    return {op for op in global_accesses(ptx, "atom") if "add" in op}


def test_the_vector_kernel_adds_four_columns_per_atomic_on_sm90():
    if row_accumulate.interpreted():
        pytest.skip("this process imported triton with TRITON_INTERPRET=1")
    wide = _atomics_in_ptx(768)  # NgramConfig.dim
    assert wide == {"atom.global.gpu.relaxed.add.v4.f32"}, wide
    assert _atomics_in_ptx(259) == {"atom.global.gpu.relaxed.add.f32"}
