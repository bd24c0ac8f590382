"""AnvilAndAdam compiled (inductor, Triton) on one CUDA GPU: parity, no recompiles, no host sync.

Scope: the compiled optimizer (the default on CUDA) against the eager one over 10 steps with lr and
momentum changing every step, the tie and the untie, value_embeds through a grad buffer: fp32
parameters with Polar Express in fp32 and TF32 off (tight), and bf16 parameters with bf16 Polar
Express (the trainer's setting: loose, since the two paths round bf16 products differently); no
graph compiled after each graph's first step; the state addresses unchanged; step() with
torch.cuda.set_sync_debug_mode("error") after the first two steps (any synchronising call in the
step raises), compiled and eager.
Hardware: 1 CUDA GPU (~1-2 min, mostly inductor compiles).
Run: `.venv/bin/python -m pytest -m gpu tests/test_anvil_gpu.py -q`.
"""

import pytest
import torch

from tests.test_anvil_fused import _opt, _run
from tests.test_anvil_math import Tiny
from track_1_short.perf.compile_cache import graphs_compiled

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _cuda_tiny(dtype):
    return Tiny(vocab=96, dim=64, dtype=dtype).cuda()


@pytest.mark.parametrize("dtype, ortho, rtol", [(torch.float32, "float32", 1e-4),
                                                (torch.bfloat16, "auto", 2e-2)])
def test_compiled_matches_eager_without_recompiles(dtype, ortho, rtol, fp32_matmuls):
    torch._dynamo.reset()
    eager_model, compiled_model = _cuda_tiny(dtype), _cuda_tiny(dtype)
    start = {n: p.detach().float().clone() for n, p in eager_model.named_parameters()}
    eager = _opt(eager_model, compile=False, ortho_dtype=ortho)
    compiled = _opt(compiled_model, ortho_dtype=ortho)  # compile=None: on for CUDA parameters
    assert (eager.compiled, compiled.compiled) == (False, True)
    ptrs = [t.data_ptr() for _, t in compiled.named_state_tensors()]
    _run(eager_model, eager, range(10), seed=30, untie_after=3)
    base = graphs_compiled()
    counts = [c - base for c in _run(compiled_model, compiled, range(10), seed=30, untie_after=3)]
    assert counts[1] == counts[4] and counts[5] == counts[-1], f"recompiled: {counts}"
    assert [t.data_ptr() for _, t in compiled.named_state_tensors()] == ptrs
    for (name, p), q in zip(eager_model.named_parameters(), compiled_model.parameters()):
        # relative to the total update; floored at one bf16 ulp of the parameter, since a bf16
        # parameter whose updates stay below its rounding (smear_gate, lr 8e-5) never moves: 0/0
        moved = (p.float() - start[name]).norm()
        floor = start[name].norm() * (2.0 ** -8 if dtype == torch.bfloat16 else 1e-7)
        err = ((q.float() - p.float()).norm() / torch.maximum(moved, floor)).item()
        assert err < rtol, f"{name}: compiled vs eager {err:.2e} of the update"


@pytest.mark.parametrize("compile", [True, False])
def test_step_has_no_host_sync(compile):
    torch._dynamo.reset()
    model = _cuda_tiny(torch.bfloat16)
    opt = _opt(model, compile=compile)
    _run(model, opt, range(2), seed=31)  # first even and odd step: compiles (which may sync)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _run(model, opt, range(2, 8), seed=32)  # lr and momentum change every step
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert all(torch.isfinite(p).all() for p in model.parameters())
