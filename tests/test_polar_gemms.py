"""Polar Express's quack GEMMs (kernels/polar_gemms.py, AnvilConfig.polar_gemms="quack") on the
CPU, with a torch stand-in for quack's gemm_symmetric / gemm_add that asserts the operand roles
(gram: B the transpose view of A's storage; C never the output; alpha and beta Python floats of
the expected values) and mirrors one triangle as quack does: polar_express with the quack strategy
equals the torch one (float64 and float32; tall, wide, square), eagerly and compiled; the
optimizer with it (uncompiled and compiled with aot_eager) gives the torch strategy's update;
the stand-in and the parity catch a wrong operand; the config, the trainer's build, the
optimizer and the preflight refuse what cannot run; the GPU tests' shapes are the model's banks
and bench/polar_express.py's CPU smoke runs. The kernels: tests/test_polar_gemms_gpu.py.

Hardware: CPU only, ~15 s. Run: `.venv/bin/python -m pytest tests/test_polar_gemms.py -q`.
"""

import pytest
import torch

from tests.test_anvil_fused import _run
from tests.test_anvil_math import Tiny, cfgs_of
from track_1_short import config as config_mod
from track_1_short.kernels import polar_gemms
from track_1_short.optim.anvil import AnvilAndAdam
from track_1_short.optim.anvil_config import AnvilConfig
from track_1_short.optim.polar_express import (POLAR_EXPRESS_COEFFS, TORCH_PE_GEMMS, PolarGemms,
                                               polar_express)

F64 = torch.float64
SHAPES = [(4, 96, 32), (4, 32, 96), (2, 48, 48)]  # tall, wide, square [L, R, C]


def _same_storage(a, b) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class _StandIn:
    """quack.gemm_interface's gemm_symmetric and gemm_add in torch, checking how they are called."""

    def __init__(self):
        self.calls = []  # (name, alpha, beta, has C)

    def gemm_symmetric(self, A, B, C=None, out=None, alpha=1.0, beta=1.0):
        # gemm_symmetric's contract: B is A.mT of one tensor (that makes D symmetric)
        assert _same_storage(A, B) and B.shape == A.mT.shape and B.stride() == A.mT.stride() \
            and B.storage_offset() == A.storage_offset(), "gemm_symmetric: B is not A.mT"
        self._check(A, B, C, out, alpha, beta)
        d = alpha * (A @ B) + (0 if C is None else beta * C)
        # quack computes the lower triangle's tiles and mirrors them
        out.copy_(d.tril() + d.tril(-1).mT)
        self.calls.append(("gemm_symmetric", alpha, beta, C is not None))
        return out

    def gemm_add(self, A, B, C, out=None, alpha=1.0, beta=1.0):
        self._check(A, B, C, out, alpha, beta)
        out.copy_(alpha * (A @ B) + beta * C)
        self.calls.append(("gemm_add", alpha, beta, True))
        return out

    @staticmethod
    def _check(A, B, C, out, alpha, beta):
        assert out is not None, "the ops pass a fresh output"
        assert C is None or not _same_storage(C, out), "C shares the output's storage"
        assert not (_same_storage(A, out) or _same_storage(B, out)), "an operand is the output"
        # quack reads a non-float alpha / beta as a device tensor
        assert type(alpha) is float and type(beta) is float, (type(alpha), type(beta))
        assert A.shape[-1] == B.shape[-2] and out.shape == (*A.shape[:-1], B.shape[-1])


def _opt(model, gemms=TORCH_PE_GEMMS, **kw):
    """tests/test_anvil_fused.py's optimizer (tied embed and head, value_embeds through a grad
    buffer), with Polar Express's GEMMs `gemms`."""
    opt = AnvilAndAdam(cfgs_of(model), AnvilConfig(**kw),
                       tied_embed_head=(model.embed.weight, model.lm_head),
                       names={p: n for n, p in model.named_parameters()}, polar_gemms=gemms)
    ve = model.value_embeds.weight
    opt.set_grad_buffer(ve, torch.zeros(ve.shape, device=ve.device))
    return opt


@pytest.fixture
def stand_in(monkeypatch):
    fake = _StandIn()
    monkeypatch.setattr(polar_gemms, "_lib", fake)
    return fake


def _g(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype, tol", [(F64, 1e-13), (torch.float32, 1e-5)])
def test_equals_the_torch_strategy(stand_in, shape, dtype, tol):
    g = _g(shape).float()
    got = polar_express(g, dtype, gemms=polar_gemms.QUACK_PE_GEMMS)
    ref = polar_express(g, dtype)
    assert got.dtype == dtype and got.shape == g.shape
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    assert torch.equal(polar_express(g, dtype, gemms=TORCH_PE_GEMMS), ref)  # None is torch's
    # per iteration: the Gram matrix, the polynomial (C = A), the update (C = x), with the
    # coefficients as alpha / beta
    expected = []
    for a, b, c in POLAR_EXPRESS_COEFFS:
        expected += [("gemm_symmetric", 1.0, 1.0, False), ("gemm_symmetric", c, b, True),
                     ("gemm_add", 1.0, a, True)]
    assert stand_in.calls == expected


@pytest.mark.parametrize("shape", SHAPES)
def test_compiled_equals_eager(stand_in, shape):
    """The custom ops are opaque to torch.compile(fullgraph=True) (the stand-in runs at run time,
    with the real operands, checking them)."""
    torch._dynamo.reset()
    g = _g(shape, seed=1).float()
    fn = torch.compile(polar_express, fullgraph=True, dynamic=False, backend="aot_eager")
    got = fn(g, torch.float32, POLAR_EXPRESS_COEFFS, polar_gemms.QUACK_PE_GEMMS)
    torch.testing.assert_close(got, polar_express(g, torch.float32), rtol=2e-5, atol=2e-5)
    assert len(stand_in.calls) == 3 * len(POLAR_EXPRESS_COEFFS)  # the compiled run (the reference: torch)


def test_the_checks_can_fail(stand_in):
    """A Gram matrix from a copy instead of the transpose view is refused, so is an integer beta;
    a strategy with the polynomial's coefficients exchanged is caught by the parity."""
    a = _g((2, 8, 4))
    with pytest.raises(AssertionError, match="B is not A.mT"):
        stand_in.gemm_symmetric(a, a.mT.contiguous(), out=torch.empty(2, 8, 8, dtype=F64))
    with pytest.raises(AssertionError):
        stand_in.gemm_add(a, a.mT, None, out=torch.empty(2, 8, 8, dtype=F64), beta=1)
    q = polar_gemms.QUACK_PE_GEMMS  # with b and c (beta and alpha) exchanged:
    wrong = PolarGemms(name="quack", gram=q.gram, poly=lambda gram, b, c: q.poly(gram, c, b),
                       apply=q.apply)
    g = _g((2, 24, 8)).float()
    ref = polar_express(g, F64)
    got = polar_express(g, F64, gemms=wrong)
    assert not torch.allclose(got, ref, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("compiled", [False, True])
def test_optimizer_update_equals_the_torch_strategy(stand_in, compiled):
    """AnvilAndAdam with the quack strategy (tall, wide and square banks) over steps with Adam
    and the untie: the same parameters as with torch's."""
    torch._dynamo.reset()
    kw = dict(compile=compiled, compile_backend="aot_eager")
    ref_model, model = Tiny(), Tiny()
    ref = _opt(ref_model, **kw)
    opt = _opt(model, polar_gemms.QUACK_PE_GEMMS, **kw, polar_gemms="quack")
    _run(ref_model, ref, range(4), seed=3, untie_after=1)
    _run(model, opt, range(4), seed=3, untie_after=1)
    assert len(stand_in.calls) == 4 * 3 * 3 * len(POLAR_EXPRESS_COEFFS)  # steps x banks x GEMMs
    for (name, p), q in zip(ref_model.named_parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)


def test_config_and_optimizer_refusals():
    with pytest.raises(ValueError, match="polar_gemms"):
        AnvilConfig(polar_gemms="cublas")
    model = Tiny()
    with pytest.raises(ValueError, match="optim.polar_gemms='quack'"):
        AnvilAndAdam(cfgs_of(model), AnvilConfig(polar_gemms="quack"))
    with pytest.raises(ValueError, match="optim.polar_gemms='torch'"):
        AnvilAndAdam(cfgs_of(model), AnvilConfig(), polar_gemms=polar_gemms.QUACK_PE_GEMMS)


def test_build_refuses_quack_where_it_cannot_run(tmp_path):
    from track_1_short.trainer.build import resolve_polar_gemms

    assert resolve_polar_gemms("torch", torch.device("cpu")) is TORCH_PE_GEMMS
    with pytest.raises(ValueError, match="optim.polar_gemms=quack cannot run on cpu: needs CUDA"):
        resolve_polar_gemms("quack", torch.device("cpu"))
    with pytest.raises(SystemExit) as e:  # the AdamW baseline has no Polar Express
        config_mod.parse(["--preset", "cpu-tiny", "--data-dir", str(tmp_path), "--optimizer",
                          "adamw", "--set", "optim.polar_gemms=quack"])
    assert e.value.code == 2


def test_build_passes_the_quack_strategy(monkeypatch, tmp_path):
    from track_1_short.trainer import build

    monkeypatch.setattr(polar_gemms, "polar_express_unavailable_reason", lambda device: None)
    assert build.resolve_polar_gemms("quack", torch.device("cpu")) is polar_gemms.QUACK_PE_GEMMS


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_preflight_refuses_quack_on_the_cpu_exit_2(tmp_path, capsys):
    from track_1_short.train import train

    cfg = config_mod.parse(["--preset", "cpu-tiny", "--set", "optim.polar_gemms=quack",
                            "--runs-dir", str(tmp_path)])
    assert train(cfg) == 2
    err = capsys.readouterr().err
    assert "--set optim.polar_gemms=quack runs a CUDA kernel and this run is on the CPU" in err
    assert "Traceback" not in err and not list(tmp_path.iterdir())


def test_gpu_bank_shapes_are_the_models_and_the_bench_smoke_runs(tmp_path):
    """tests/test_polar_gemms_gpu.py's shapes are the speedrun model's banks (as the bench reads
    them); the bench's CPU smoke writes its JSON (torch's GEMMs; quack's row says why not)."""
    import json

    from bench import polar_express as bench
    from tests.test_polar_gemms_gpu import BANKS

    assert bench.bank_shapes() == BANKS
    out = tmp_path / "pe.json"
    assert bench.main(["--smoke", "--steps", "2", "--warmup", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["complete"] and set(result["banks"]) == set(BANKS)
    for bank in result["banks"].values():
        assert bank["strategies"]["torch"]["event_ms"]["n"] == 2
        assert "unavailable" in bank["strategies"]["quack"] and bank["saving_ms"] is None
