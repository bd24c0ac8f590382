"""bench/gemm_memsets.py off the GPU: the GEMM list's shapes at a small token count, the variant
choice (no memset at any token count and never slower than the default, the fastest such), the
--choice-env file it writes, and the refusals of bad flags (exit 2 naming the flag).
Hardware: CPU, ~3 s. Run: `.venv/bin/python -m pytest tests/test_gemm_memsets_bench.py -q`.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import gemm_memsets

REPO = Path(__file__).resolve().parents[1]


def test_gemm_ops_run_at_the_model_shapes_on_cpu():
    ops = gemm_memsets.gemm_ops(8, torch.device("cpu"))
    shapes = {name: tuple(fn().shape) for name, fn in ops.items()}
    d, f = gemm_memsets.D, gemm_memsets.FF
    assert shapes["qk_fwd"] == (8, 2 * d) and shapes["qk_dx"] == (8, d) and shapes["qk_dw"] == (2 * d, d)
    assert shapes["mlp_down_fwd"] == (8, d) and shapes["mlp_down_dw"] == (d, f)
    assert shapes["pe_update_tall"] == (gemm_memsets.TALL, f, d)
    assert shapes["pe_poly_square"] == (gemm_memsets.SQUARE, d, d)


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
