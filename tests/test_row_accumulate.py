"""The n-gram hold's atomic-free row accumulation (track_1_short/kernels/row_accumulate.py) on
the CPU.

Scope: the kernel cases (tests/row_accumulate_cases.py: against acc.index_add_ over runs of one
row, distinct rows, real n-gram row ids, strided gradients, input errors) run in a child pytest
process with TRITON_INTERPRET=1, which must be set before triton is imported and must not leak
into this process. Here, without the interpreter: a CPU call is a clear error.
Hardware: CPU (needs triton installed; skipped otherwise); ~15 s.
Run: `PYTHONPATH=. .venv/bin/python -m pytest tests/test_row_accumulate.py -q`.
"""

import pytest
import torch

pytest.importorskip("triton")

from tests.interpreter_cases import run_interpreter_cases  # noqa: E402
from track_1_short.kernels import row_accumulate  # noqa: E402

NUM_CASES = 10  # tests in row_accumulate_cases.py (parametrizations included)


def test_kernel_cases_in_the_triton_interpreter():
    run_interpreter_cases("row_accumulate_cases.py", NUM_CASES)


def test_a_cpu_call_is_an_error():
    if row_accumulate.interpreted():
        pytest.skip("this process imported triton with TRITON_INTERPRET=1")
    with pytest.raises(ValueError, match="runs on CUDA"):
        row_accumulate.row_accumulate_(torch.zeros(4, 3), torch.zeros(2, dtype=torch.int64),
                                       torch.zeros(2, 3))
