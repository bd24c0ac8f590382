"""The fused lm-head + softcapped CE op (track_1_short/kernels/softcap_ce.py) on the CPU.

Scope: the kernel cases (tests/softcap_ce_cases.py: loss, logit gradient, dx and dw against a
float64 reference and against model/loss.py's torch path, opcheck, torch.compile, the fp8 head)
run in a child pytest process with TRITON_INTERPRET=1, which must be set before triton is
imported and must not leak into this process. The default run takes a subset of them
(QUICK_CASES: the float64 parity of loss, dx and dw for one float32 N = 3 case, the bf16 logit
gradient element by element, the tail rows / zero weights / -1 prefixes case, opcheck); all of
them run under the `slow` marker. Here, without the interpreter: the fake (meta) registration at
the speedrun's shapes, every input error, LaunchConfig validation, and the clear error for CPU
tensors when the kernel is not interpreted.
Hardware: CPU (needs triton installed; skipped otherwise); the subset's child process ~30 s on 2
cores, all cases (slow) ~3-4 min, the rest < 5 s.
Run: `PYTHONPATH=. .venv/bin/python -m pytest tests/test_softcap_ce.py -q`; all the kernel cases:
`PYTHONPATH=. .venv/bin/python -m pytest -m slow tests/test_softcap_ce.py -q`.

Legend: T tokens, D model dim, V vocab, N MTP targets.
"""


import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

pytest.importorskip("triton")

from tests.interpreter_cases import run_interpreter_cases  # noqa: E402
from track_1_short.kernels import softcap_ce  # noqa: E402
from track_1_short.kernels.softcap_ce import LaunchConfig, linear_softcap_ce  # noqa: E402

NUM_CASES = 36  # tests in softcap_ce_cases.py (parametrizations included)
# The default run's subset of them, by node id (one test each): the interpreter is on, the
# float64 parity of loss, dx and dw (float32, N = 3 with prefixes, V past the last full chunk, the
# default math: FMA exp in pass 2, tanh sigmoid), the bf16 logit gradient element by element
# (two-pass), tail rows / an MTP weight of 0 / all prefixes -1 (one pass), and opcheck.
QUICK_CASES = (
    "test_kernel_is_interpreted",
    "test_loss_and_gradients_match_float64_reference[float32-N3-T67-V397-small_tanh]",
    "test_logit_gradient_written_over_the_logits[bfloat16-two_pass]",
    "test_tail_rows_zero_weights_and_missing_prefixes[one_pass]",
    "test_opcheck[two_pass]",
)
NUM_QUICK_CASES = 5


def test_kernel_cases_in_the_triton_interpreter():
    """The default run's subset (~30 s on 2 cores)."""
    run_interpreter_cases("softcap_ce_cases.py", NUM_QUICK_CASES, timeout_s=600, show_output=True,
                          select=QUICK_CASES)


@pytest.mark.slow
def test_all_kernel_cases_in_the_triton_interpreter():
    """Every case (~3-4 min on 2 cores)."""
    run_interpreter_cases("softcap_ce_cases.py", NUM_CASES, timeout_s=900, show_output=True)


def _args(t=49152, d=768, v=50304, n=3, device="cuda", dtype=torch.bfloat16):
    """Speedrun-shaped inputs (stage C tokens, N = 3 as in stage A), on `device`."""
    return (torch.empty(t, d, dtype=dtype, device=device), torch.empty(d, v, dtype=dtype, device=device),
            torch.zeros(t, dtype=torch.int64, device=device), torch.ones(n, device=device),
            torch.tensor(0.25, device=device), torch.full((t,), -1, dtype=torch.int64, device=device))


def test_fake_registration_gives_loss_and_logit_gradient_shapes():
    with FakeTensorMode():
        args = _args()
        loss, dz, scale = softcap_ce.linear_softcap_ce_op(*args, 4096, 16, 2, True, 1)
        assert loss.shape == (49152,) and loss.dtype == torch.float32 and loss.device.type == "cuda"
        assert dz.shape == (49152, 50304) and dz.dtype == torch.bfloat16
        assert scale.shape == (49152,) and scale.dtype == torch.float32
    with FakeTensorMode():  # autograd through the fake kernel (CPU fakes: the CPU build has no CUDA autograd)
        args = _args(device="cpu")
        x, w = args[0].requires_grad_(), args[1].requires_grad_()
        out = linear_softcap_ce(x, w, *args[2:])
        assert out.shape == (49152,) and out.requires_grad
        dx, dw = torch.autograd.grad(out.sum(), (x, w))
        assert dx.shape == x.shape and dw.shape == w.shape and dw.dtype == torch.bfloat16


def _with(index, value):
    args = list(_args(t=16, d=8, v=40, device="cpu"))
    args[index] = value
    return args


@pytest.mark.parametrize("args,match", [
    (_with(0, torch.empty(16, 9, dtype=torch.bfloat16)), "x \\[T, D\\] and w \\[D, V\\]"),
    (_with(0, torch.empty(16, 8)), "one dtype"),
    (_with(1, torch.empty(8, 40, dtype=torch.float16)), "one dtype"),
    (_with(2, torch.zeros(16, dtype=torch.int32)), "targets needs int64"),
    (_with(5, torch.zeros(15, dtype=torch.int64)), "prefix_targets needs int64"),
    (_with(3, torch.ones(0)), "mtp_weights needs float32"),
    (_with(3, torch.ones(2, dtype=torch.float64)), "mtp_weights needs float32"),
    (_with(4, torch.tensor([0.25])), "prefix_weight needs a float32 0-d"),
    (_with(0, torch.empty(0, 8, dtype=torch.bfloat16)), "empty input"),
])
def test_bad_inputs_are_value_errors(args, match):
    with pytest.raises(ValueError, match=match):
        linear_softcap_ce(*args)


def test_inputs_on_two_devices_are_a_value_error():
    with FakeTensorMode():
        args = list(_args(t=16, d=8, v=40, device="cpu"))
        args[1] = torch.empty(8, 40, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(ValueError, match="one device"):
            linear_softcap_ce(*args)


@pytest.mark.parametrize("kwargs,match", [({"block_v": 1000}, "block_v=1000"), ({"block_v": 8}, "block_v=8"),
                                          ({"num_warps": 3}, "num_warps=3"),
                                          ({"programs_per_sm": 0}, "programs_per_sm=0"),
                                          ({"fma_exp_passes": 3}, "fma_exp_passes=3"),
                                          ({"tanh_sigmoid": True, "fast_math": False}, "tanh_sigmoid=True"),
                                          ({"recompute": True}, "recompute=True needs one_pass=True")])
def test_launch_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LaunchConfig(**kwargs)


def test_launch_config_travels_through_the_ops_arguments():
    launch = LaunchConfig(block_v=512, num_warps=2, programs_per_sm=3, fast_math=False, fma_exp_passes=2,
                          tanh_sigmoid=False, one_pass=True)
    assert LaunchConfig.from_op_args(*launch.op_args()) == launch
    with pytest.raises(ValueError):  # one argument short: refused, never a default in its place
        LaunchConfig.from_op_args(*launch.op_args()[:-1])


def test_cpu_tensors_without_the_interpreter_are_a_clear_error():
    if softcap_ce.interpreted():
        pytest.skip("this process imported triton with TRITON_INTERPRET=1")
    args = _args(t=16, d=8, v=40, device="cpu")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        linear_softcap_ce(*args)


def test_the_bf16_op_refuses_the_recompute_schedule():
    """recompute leaves the logits in place, which the bf16 head's backward GEMMs cannot use."""
    from track_1_short.kernels.softcap_ce import RECOMPUTE_LAUNCH, default_launch
    assert default_launch("recompute") == RECOMPUTE_LAUNCH and RECOMPUTE_LAUNCH.one_pass
    with pytest.raises(ValueError, match="fp8 lm head's schedule"):
        linear_softcap_ce(*_args(t=16, d=8, v=40, device="cpu"), launch=RECOMPUTE_LAUNCH)
    with pytest.raises(ValueError, match="schedule 'three_pass'"):
        default_launch("three_pass")


def _grad_args(t=49152, v=50304, n=1, device="cuda"):
    """fp8_logit_grad's inputs at stage C's shapes."""
    f32 = dict(dtype=torch.float32, device=device)
    return (torch.empty(t, v, dtype=torch.bfloat16, device=device), torch.empty(t, **f32),
            torch.empty(t, **f32), torch.zeros(t, dtype=torch.int64, device=device),
            torch.full((t,), -1, dtype=torch.int64, device=device), torch.ones(n, **f32),
            torch.tensor(0.0, **f32), torch.tensor(1e-3, **f32))


def test_fp8_logit_grad_fake_registration_gives_both_layouts():
    from track_1_short.kernels.fp8_logit_grad import fp8_logit_grad
    from track_1_short.kernels.softcap_ce import RECOMPUTE_LAUNCH
    with FakeTensorMode():
        row, col = fp8_logit_grad(*_grad_args(), RECOMPUTE_LAUNCH)
        assert row.shape == col.shape == (49152, 50304) and row.dtype == col.dtype == torch.float8_e5m2
        assert row.stride() == (50304, 1) and col.stride() == (1, 49152)


@pytest.mark.parametrize("index,value,match", [
    (0, torch.empty(16, 40), None), (0, torch.empty(40, 16, dtype=torch.bfloat16).t(), "contiguous"),
    (1, torch.empty(15), "h needs float32"), (2, torch.empty(16, dtype=torch.float64), "g needs float32"),
    (3, torch.zeros(16, dtype=torch.int32), "targets needs int64"),
    (7, torch.tensor([1e-3]), "scale needs a float32 0-d"),
])
def test_fp8_logit_grad_bad_inputs_are_value_errors(index, value, match):
    from track_1_short.kernels.fp8_logit_grad import fp8_logit_grad
    from track_1_short.kernels.softcap_ce import RECOMPUTE_LAUNCH
    args = list(_grad_args(t=16, v=40, device="cpu"))
    args[index] = value
    with FakeTensorMode(allow_non_fake_inputs=True):
        if match is None:  # float32 logits are fine
            fp8_logit_grad(*args, RECOMPUTE_LAUNCH)
        else:
            with pytest.raises(ValueError, match=match):
                fp8_logit_grad(*args, RECOMPUTE_LAUNCH)
