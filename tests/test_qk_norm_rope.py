"""The q/k rms-norm + RoPE kernel (track_1_short/kernels/qk_norm_rope.py) on the CPU.

Scope: the kernel cases (tests/qk_norm_rope_cases.py: against the model's torch path, forward and
gradient, unpaired and paired, float32 and bfloat16, the tiny GPT with the kernel installed,
under torch.compile, input errors) run in a child pytest process with TRITON_INTERPRET=1, which
must be set before triton is imported and must not leak into this process. Here, without the
interpreter: a CPU call is a clear error, the trainer's install refuses a CPU model, a bad
setting is refused by the config, and both kernels compile for sm_90 (PTX, no GPU needed) with
every row load and store vectorised (16 bytes: no 2-byte scalar access of a bf16 row).
Hardware: CPU (needs triton installed; skipped otherwise); ~20 s.
Run: `PYTHONPATH=. .venv/bin/python -m pytest tests/test_qk_norm_rope.py -q`.
"""

import pytest
import torch

pytest.importorskip("triton")

from tests.interpreter_cases import run_interpreter_cases  # noqa: E402
from tests.triton_ptx import global_accesses, sm90_ptx  # noqa: E402
from track_1_short import config as config_mod  # noqa: E402
from track_1_short.kernels import qk_norm_rope  # noqa: E402
from track_1_short.model.gpt import GPT, GPTConfig  # noqa: E402
from track_1_short.trainer import build  # noqa: E402

NUM_CASES = 18  # tests in qk_norm_rope_cases.py (parametrizations included)


def test_kernel_cases_in_the_triton_interpreter():
    run_interpreter_cases("qk_norm_rope_cases.py", NUM_CASES)


def test_a_cpu_call_is_an_error():
    if qk_norm_rope.interpreted():
        pytest.skip("this process imported triton with TRITON_INTERPRET=1")
    with pytest.raises(ValueError, match="runs on CUDA"):
        qk_norm_rope.qk_norm_rope(torch.zeros(4, 2, 2, 32), torch.zeros(8, 32), torch.zeros(8, 32), False)


def test_the_install_refuses_a_cpu_model_and_the_config_a_bad_name(capsys):
    model = GPT(GPTConfig.tiny())
    with pytest.raises(ValueError, match="train.qk_norm_rope=triton runs a CUDA kernel"):
        build.prepare_for_device(model, torch.device("cpu"), qk_norm_rope="triton")
    build.prepare_for_device(model, torch.device("cpu"))  # "torch": nothing installed
    assert model.qk_norm_rope is None
    with pytest.raises(SystemExit) as exit_info:
        config_mod.parse(["--preset", "cpu-tiny", "--set", "train.qk_norm_rope=cuda"])
    assert exit_info.value.code == 2
    assert "train.qk_norm_rope='cuda': one of ('torch', 'triton')" in capsys.readouterr().err


def _ptx(kernel, paired: bool) -> str:
    """`kernel` compiled for sm_90 at the speedrun's heads (6 x 128, bf16), every pointer aligned."""
    types = {"qk_ptr": "*bf16", "q_ptr": "*bf16", "k_ptr": "*bf16", "gq_ptr": "*bf16",
             "gk_ptr": "*bf16", "dqk_ptr": "*bf16",
             "cos_ptr": "*fp32", "sin_ptr": "*fp32", "rstd_ptr": "*fp32", "n_rows": "i32", "eps": "fp32"}
    _, _, meta = qk_norm_rope._launch(torch.empty(8, 2, 6, 128), paired, qk_norm_rope.Tiling())
    consts = {k: v for k, v in meta.items() if k != "num_warps"}
    return sm90_ptx(kernel, types, consts, [n for n in kernel.arg_names if n.endswith("_ptr")])


@pytest.mark.parametrize("paired", [False, True])
def test_both_kernels_compile_for_sm90_with_vector_row_access(paired):
    if qk_norm_rope.interpreted():
        pytest.skip("this process imported triton with TRITON_INTERPRET=1")
    for kernel in (qk_norm_rope._fwd, qk_norm_rope._bwd):
        ptx = _ptx(kernel, paired)
        loads, stores = global_accesses(ptx, "ld"), global_accesses(ptx, "st")
        assert "ld.global.v4.b32" in loads and "st.global.v4.b32" in stores, (loads, stores)
        assert not any(op.endswith(("b16", "u16")) for op in loads | stores), (loads, stores)
