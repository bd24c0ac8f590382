"""The fp8 quantisation into both layouts (track_1_short/kernels/fp8_quantise.py) on the CPU.

Scope: the kernel cases (tests/fp8_quantise_cases.py: bitwise against model/fp8.py's quantise,
row_major and col_major, opcheck, torch.compile) run in a child pytest process with
TRITON_INTERPRET=1, which must be set before triton is imported and must not leak into this
process. Here, without the interpreter: every input error (a ValueError naming the argument),
QuantiseLaunch validation, the clear error for CPU tensors when the kernel is not interpreted,
the fake registration at the stage-C gradient's shape, and the fp8 lm-head loss's forward +
backward on fake tensors at stage C (its backward calls the op).
Hardware: CPU (needs triton installed; skipped otherwise); the child process ~20 s, the rest < 5 s.
Run: `PYTHONPATH=. .venv/bin/python -m pytest tests/test_fp8_quantise.py -q`.

Legend: R rows, C columns; T tokens, D model dim, V vocab.
"""


import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

pytest.importorskip("triton")

from tests.interpreter_cases import run_interpreter_cases  # noqa: E402
from track_1_short.kernels import fp8_quantise  # noqa: E402
from track_1_short.kernels.fp8_quantise import QuantiseLaunch, quantise_both_layouts  # noqa: E402
from track_1_short.model.fp8 import (E4M3, E5M2, LM_HEAD_GRAD_SCALE, LM_HEAD_W_SCALE,  # noqa: E402
                                     LM_HEAD_X_SCALE)

NUM_CASES = 16  # tests in fp8_quantise_cases.py (parametrizations included)
T, D, V = 49152, 768, 50304  # stage C


def test_kernel_cases_in_the_triton_interpreter():
    run_interpreter_cases("fp8_quantise_cases.py", NUM_CASES)


def _call(t=None, scale=None, dtype=E5M2, row_mul=None):
    t = torch.zeros(8, 16, dtype=torch.bfloat16) if t is None else t
    return quantise_both_layouts(t, torch.tensor(1.0) if scale is None else scale, dtype, row_mul)


@pytest.mark.parametrize("kwargs,match", [
    ({"t": torch.zeros(16, dtype=torch.bfloat16)}, r"t needs \[R, C\]"),
    ({"t": torch.zeros(2, 8, 16, dtype=torch.bfloat16)}, r"t needs \[R, C\]"),
    ({"t": torch.zeros(8, 16, dtype=torch.float16)}, "t needs a dtype"),
    ({"t": torch.zeros(0, 16, dtype=torch.bfloat16)}, "t is empty"),
    ({"dtype": torch.bfloat16}, "dtype needs one of"),
    ({"dtype": torch.float8_e4m3fnuz}, "dtype needs one of"),
    ({"scale": torch.tensor(1.0, dtype=torch.float64)}, "scale needs a float32 0-d"),
    ({"scale": torch.tensor([1.0])}, "scale needs a float32 0-d"),
    ({"row_mul": torch.ones(7)}, r"row_mul needs float32 \[R=8\]"),
    ({"row_mul": torch.ones(8, 1)}, r"row_mul needs float32 \[R=8\]"),
    ({"row_mul": torch.ones(8, dtype=torch.bfloat16)}, r"row_mul needs float32 \[R=8\]"),
])
def test_bad_inputs_are_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _call(**kwargs)


def test_scale_and_row_mul_on_another_device_are_value_errors():
    with FakeTensorMode():
        t = torch.empty(8, 16, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(ValueError, match="scale needs a float32 0-d tensor on t's device"):
            _call(t=t, scale=torch.tensor(1.0))
        with pytest.raises(ValueError, match="row_mul needs float32 .* on t's device"):
            _call(t=t, scale=torch.tensor(1.0, device="cuda"), row_mul=torch.ones(8))


@pytest.mark.parametrize("kwargs,match", [({"block_r": 48}, "block_r=48"), ({"block_c": 0}, "block_c=0"),
                                          ({"num_warps": 3}, "num_warps=3")])
def test_launch_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuantiseLaunch(**kwargs)


def test_cpu_tensors_without_the_interpreter_are_a_clear_error():
    if fp8_quantise.interpreted():
        pytest.skip("this process imported triton with TRITON_INTERPRET=1")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        _call()


@pytest.mark.parametrize("dtype", [E5M2, E4M3], ids=["e5m2", "e4m3"])
def test_fake_registration_gives_both_layouts(dtype):
    """The stage-C logit gradient [T, V] bf16 with its row multiplier: row-major and column-major
    outputs of the fp8 dtype on t's device."""
    with FakeTensorMode():
        t = torch.empty(T, V, dtype=torch.bfloat16, device="cuda")
        g = torch.empty(T, device="cuda")
        row, col = quantise_both_layouts(t, torch.tensor(0.5, device="cuda"), dtype, g)
        assert row.shape == col.shape == (T, V) and row.dtype == col.dtype == dtype
        assert row.stride() == (V, 1) and col.stride() == (1, T) and col.device.type == "cuda"


def test_fp8_lm_head_forward_and_backward_on_fake_tensors():
    """linear_softcap_ce_fp8 at stage C through autograd on fake tensors (CPU fakes: the CPU build
    has no CUDA autograd): the backward's quantisation is the op's fake kernel, the GEMMs
    t1s::scaled_mm's; dx, dw come back in x's and w's shapes and dtype."""
    from track_1_short.kernels.softcap_ce_fp8 import linear_softcap_ce_fp8

    with FakeTensorMode():
        x = torch.empty(T, D, dtype=torch.bfloat16).requires_grad_()
        w = torch.empty(D, V, dtype=torch.bfloat16).requires_grad_()
        scales = {name: torch.tensor(value) for name, value in
                  (("x_s", LM_HEAD_X_SCALE), ("w_s", LM_HEAD_W_SCALE), ("grad_s", LM_HEAD_GRAD_SCALE))}
        loss = linear_softcap_ce_fp8(x, w, torch.zeros(T, dtype=torch.int64), torch.ones(1),
                                     torch.tensor(0.25), torch.full((T,), -1, dtype=torch.int64),
                                     **scales)
        assert loss.shape == (T,) and loss.requires_grad
        dx, dw = torch.autograd.grad(loss.sum(), (x, w))
        assert dx.shape == x.shape and dw.shape == w.shape
        assert dx.dtype == dw.dtype == torch.bfloat16
