"""bench/gemm_memsets.py off the GPU: the GEMM list's output shapes and dtype at the model's
shapes and a small token count (every op traced under FakeTensorMode: shapes propagate, no
arithmetic runs), the variant choice (no memset at any token count and never slower than the
default, the fastest such), the --choice-env file it writes, and the refusals of bad flags (exit 2
naming the flag).
Hardware: CPU, ~5 s (most of it importing torch._dynamo for FakeTensorMode, shared with other
tests). Run: `.venv/bin/python -m pytest tests/test_gemm_memsets_bench.py -q`.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from bench import gemm_memsets

REPO = Path(__file__).resolve().parents[1]


def test_gemm_ops_run_at_the_model_shapes_on_cpu():
    """Every op at the full model shapes (T = 8), as fake tensors: the inputs and each GEMM's
    output carry shapes and dtypes only (a mismatched GEMM still raises, a wrong output shape
    fails the comparison), so none of the ~10 GFLOP of the Polar Express banks runs."""
    t, d, f, tall, square = 8, gemm_memsets.D, gemm_memsets.FF, gemm_memsets.TALL, gemm_memsets.SQUARE
    with FakeTensorMode():
        ops = gemm_memsets.gemm_ops(t, torch.device("cpu"))
        outs = {name: fn() for name, fn in ops.items()}
    expected = {
        "qk_fwd": (t, 2 * d), "qk_dx": (t, d), "qk_dw": (2 * d, d),
        "v_o_fwd": (t, d), "v_o_dx": (t, d), "v_o_dw": (d, d),
        "mlp_up_fwd": (t, f), "mlp_up_dx": (t, d), "mlp_up_dw": (f, d),
        "mlp_down_fwd": (t, d), "mlp_down_dx": (t, f), "mlp_down_dw": (d, f),
        "pe_gram_tall": (tall, d, d), "pe_poly_tall": (tall, d, d), "pe_update_tall": (tall, f, d),
        "pe_gram_square": (square, d, d), "pe_poly_square": (square, d, d),
        "pe_update_square": (square, d, d),
    }
    assert {name: tuple(out.shape) for name, out in outs.items()} == expected
    assert all(out.dtype == torch.bfloat16 for out in outs.values())


def _variant(medians: dict, memsets: dict) -> dict:
    return {"by_tokens": {str(t): {"replay_ms": {"median_ms": m}, "memsets_per_replay": memsets[t]}
                          for t, m in medians.items()}}


def test_choice_needs_no_memset_and_no_slowdown_at_every_token_count():
    base = _variant({1: 10.0, 2: 30.0}, {1: 40, 2: 40})
    variants = {
        "default": base,
        "slower_at_2": _variant({1: 9.0, 2: 30.5}, {1: 0, 2: 0}),
        "memset_left": _variant({1: 8.0, 2: 20.0}, {1: 0, 2: 3}),
        "good": _variant({1: 9.9, 2: 29.0}, {1: 0, 2: 0}),
        "better": _variant({1: 9.5, 2: 28.0}, {1: 0, 2: 0}),
        "failed": {"error": "boom"},
    }
    assert gemm_memsets.choose(variants, [1, 2]) == "better"
    del variants["better"], variants["good"]
    assert gemm_memsets.choose(variants, [1, 2]) is None
    assert gemm_memsets.choose({"good": variants["slower_at_2"]}, [1, 2]) is None  # no default


@pytest.mark.parametrize("flags, expected", [
    (["--variants", "default,nope"], "--variants: unknown ['nope']"),
    (["--tokens", "16k"], "--tokens '16k': comma-separated integers"),
    (["--tokens", "0"], "--tokens [0]: each must be > 0"),
])
def test_bad_flags_exit_2_naming_the_flag(tmp_path, flags, expected):
    proc = subprocess.run([sys.executable, "bench/gemm_memsets.py", "--out", str(tmp_path / "x.json"),
                           *flags], cwd=REPO, env={"PYTHONPATH": str(REPO)}, capture_output=True,
                          text=True)
    assert proc.returncode == 2 and expected in proc.stderr, proc.stderr


def test_gate_implementations_agree_on_cpu():
    """The three gate implementations the bench times compute the same values and gradients
    (bf16 rounding apart): a timing of one is a timing of the same gate."""
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(256, gemm_memsets.GATE_K, generator=g).to(torch.bfloat16)
    w0 = torch.randn(gemm_memsets.GATE_N, gemm_memsets.GATE_K, generator=g) * 0.1
    u = torch.randn(256, gemm_memsets.GATE_N, generator=g)
    results = {}
    for impl, fn in gemm_memsets.GATE_IMPLS.items():
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        out = fn(x, w.to(x.dtype))
        (torch.sigmoid(out).float() * u).sum().backward()
        results[impl] = (out.float(), x.grad.float(), w.grad)
    ref = results["linear"]
    for impl, got in results.items():
        for a, b in zip(got, ref):
            assert torch.allclose(a, b, rtol=2e-2, atol=2e-2), impl
