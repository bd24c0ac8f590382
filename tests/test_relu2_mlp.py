"""The fused ReLU^2 MLP strategy (kernels/relu2_mlp.py, TrainConfig.mlp_kernel="quack") on the
CPU: with torch stand-ins for quack's gemm_act / gemm_dact it equals the reference
(PlainMatmuls.relu2_mlp) in output and every gradient, eagerly, under
torch.compile(fullgraph=True) and inside the whole GPT; the install refuses a device it cannot run
on, and the config refuses it beside fp8 MLP sites. The kernels: tests/test_relu2_mlp_gpu.py.

Hardware: CPU only, ~20 s. Run: `.venv/bin/python -m pytest tests/test_relu2_mlp.py -q`.
"""

import pytest
import torch

from track_1_short import config
from track_1_short.kernels import relu2_mlp
from track_1_short.model.fp8 import Fp8Matmuls, PlainMatmuls
from track_1_short.model.fp8_config import Fp8Config
from tests.test_model import _batch, _fcfg, _model, _slots


class _StandIn:
    """quack.gemm_interface's two epilogue GEMMs in torch: relu_sq(x) = max(x, 0) * x; fp8
    operands are dequantised by the tensor alpha and accumulated in float32, the epilogue reading
    the float32 accumulator (as quack's)."""

    def __init__(self):
        self.calls = []
        self.operand_dtypes = []

    def _record(self, *call):
        if not torch.compiler.is_compiling():  # a traced list append would be a graph break
            self.calls.append(call)

    def gemm_act(self, A, B, *, activation, store_preact, alpha=1.0, out_dtype=None,
                 postact_dtype=None):
        self._record("gemm_act", activation, store_preact)
        self.operand_dtypes.append((A.dtype, B.dtype))
        if A.dtype == torch.float8_e4m3fn:
            acc = (A.float() @ B.float()) * alpha
            return acc.to(out_dtype), (torch.relu(acc) * acc).to(postact_dtype)
        pre = A @ B
        return pre, torch.relu(pre) * pre

    def gemm_dact(self, A, B, PreAct, *, activation):
        self._record("gemm_dact", activation)
        return (A @ B) * 2 * torch.relu(PreAct), torch.relu(PreAct) * PreAct


@pytest.fixture
def stand_in(monkeypatch):
    fake = _StandIn()
    monkeypatch.setattr(relu2_mlp, "_lib", fake)
    return fake


def _fused_matmuls() -> PlainMatmuls:
    matmuls = PlainMatmuls()
    matmuls.use_fused_mlp(relu2_mlp.quack_relu2_mlp, relu2_mlp.QUACK_MLP_LABEL)
    return matmuls


def _operands(t=24, d=16, f=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, w_up, w_down = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((t, d), (f, d), (f, d)))
    return x, w_up, w_down


@pytest.mark.parametrize("compiled", [False, True])
def test_equals_the_reference_with_gradients(stand_in, compiled):
    x, w_up, w_down = _operands()
    fused = _fused_matmuls().relu2_mlp
    run = torch.compile(fused, fullgraph=True, dynamic=False, backend="aot_eager") if compiled else fused
    results = []
    for fn in (run, PlainMatmuls().relu2_mlp):
        leaves = [t.clone().requires_grad_() for t in (x, w_up, w_down)]
        y = fn(*leaves, layer=0)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=y.dtype)
        results.append((y, torch.autograd.grad(y, leaves, dy)))
    (y, grads), (ref, ref_grads) = results
    assert torch.allclose(y, ref)
    for name, g, r in zip(("x", "w_up", "w_down"), grads, ref_grads):
        assert torch.allclose(g, r), name
    if not compiled:
        assert stand_in.calls == [("gemm_act", "relu_sq", True), ("gemm_dact", "relu_sq")]


def test_the_whole_model_equals_the_torch_mlp(stand_in):
    """The tiny GPT with the strategy installed: loss and every gradient equal the plain model's
    (eval keeps the plain matmuls: its CE is unchanged too)."""
    inputs, targets, cu = _batch(128, 8, 3)
    losses, grads = [], []
    for fused in (False, True):
        model = _model()
        if fused:
            model.matmuls.use_fused_mlp(relu2_mlp.quack_relu2_mlp, relu2_mlp.QUACK_MLP_LABEL)
        loss = model(inputs, targets, cu, _slots(model, inputs), _fcfg([1.0, 0.5])).sum()
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert torch.allclose(losses[0], losses[1], rtol=1e-6)
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-5), name


def test_refused_where_it_cannot_run(tmp_path):
    from track_1_short.trainer.build import prepare_for_device

    with pytest.raises(ValueError, match="--mlp-kernel quack cannot run on cpu: needs CUDA"):
        prepare_for_device(_model(), torch.device("cpu"), mlp_kernel="quack")
    with pytest.raises(SystemExit) as e:
        config.parse(["--preset", "small-gpu", "--data-dir", str(tmp_path), "--mlp-kernel", "quack",
                      "--fp8"])
    assert e.value.code == 2
    cfg = config.parse(["--preset", "small-gpu", "--data-dir", str(tmp_path), "--mlp-kernel", "quack",
                        "--fp8", "--set", "model.fp8.sites=lm_head"])
    assert cfg.train.mlp_kernel == "quack"


def test_installed_inside_the_fp8_strategy_keeping_its_lm_head(stand_in, monkeypatch):
    """--mlp-kernel quack with fp8 on the lm head alone: the install keeps the installed
    Fp8Matmuls (whose lm-head scales the fused fp8 loss reads) and only the MLP becomes quack's.
    (The install used to replace the strategy, so the lm head silently ran bf16: seen in the
    H200 kernel list of 2026-12-02, docs/results/README.md.) Fp8 MLP sites refuse a fused MLP."""
    from track_1_short.model.fp8 import Fp8Matmuls
    from track_1_short.model.fp8_config import Fp8Config
    from track_1_short.trainer import build

    monkeypatch.setattr(relu2_mlp, "quack_unavailable_reason", lambda device: None)
    model = _model()
    layers = model.config.num_layers
    model.config.fp8 = Fp8Config(enabled=True, sites=("lm_head",))
    fp8 = Fp8Matmuls(model.config.fp8, num_layers=layers)
    model.matmuls = fp8
    build._install_mlp_kernel(model, torch.device("cpu"), "quack")
    assert model.matmuls is fp8 and build._fp8_sites(model) == ("lm_head",)
    assert "quack" in build.describe_strategies(model) and "fp8 (lm_head)" in build.describe_strategies(model)
    x, w_up, w_down = _operands()
    y = model.matmuls.relu2_mlp(x, w_up, w_down, layer=0)
    assert stand_in.calls == [("gemm_act", "relu_sq", True)]
    assert torch.allclose(y, PlainMatmuls().relu2_mlp(x, w_up, w_down, layer=0))
    with pytest.raises(ValueError, match=r"cannot take the fp8 sites \['mlp_down', 'mlp_up'\]"):
        Fp8Matmuls(Fp8Config(enabled=True), num_layers=layers).use_fused_mlp(
            relu2_mlp.quack_relu2_mlp, relu2_mlp.QUACK_MLP_LABEL)


# ---- the fp8 up projection (quack_relu2_mlp_fp8_up) ----

def _fp8_up_matmuls(fused: bool, mlp_backward="bf16") -> Fp8Matmuls:
    """Fp8Matmuls with the lm head and the MLP up projection in fp8, active (CPU stand-in for a
    resolved CUDA device); `fused`: with the fp8-up quack MLP installed."""
    m = Fp8Matmuls(Fp8Config(enabled=True, sites=("lm_head", "mlp_up"), mlp_backward=mlp_backward),
                   num_layers=2)
    m.active = True
    if fused:
        m.use_fused_mlp(relu2_mlp.quack_relu2_mlp_fp8_up, relu2_mlp.QUACK_MLP_FP8_UP_LABEL,
                        fp8_sites=("mlp_up",))
    return m


def _bf16_operands(t=64, d=32, f=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g)
    w_up, w_down = (torch.empty(f, d).uniform_(-0.2, 0.2, generator=g) for _ in range(2))
    dy = torch.randn(t, d, generator=g)
    return [v.bfloat16() for v in (x, w_up, w_down, dy)]


def _mlp_and_grads(fn, x, w_up, w_down, dy):
    leaves = [v.clone().requires_grad_() for v in (x, w_up, w_down)]
    y = fn(*leaves, layer=0)
    return [y.detach(), *torch.autograd.grad(y, leaves, dy)]


def _max_rel(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("compiled", [False, True])
def test_fp8_up_equals_the_unfused_fp8_up_site(stand_in, compiled):
    """The fused MLP with the fp8 up projection against its reference, the unfused "mlp_up" fp8
    site with the bf16 backward (Fp8Matmuls.relu2_mlp: the same amax scales and quantisation,
    then the plain backward): output and the three gradients agree to bf16 rounding (the fused
    epilogue squares the float32 accumulator, the reference its bf16 rounding), eagerly and
    under torch.compile(fullgraph). The up GEMM gets e4m3 operands, and the output is not the
    bf16 MLP's (the quantisation happened)."""
    operands = _bf16_operands()
    fused = _fp8_up_matmuls(True).relu2_mlp
    run = torch.compile(fused, fullgraph=True, dynamic=False, backend="aot_eager") if compiled else fused
    got = _mlp_and_grads(run, *operands)
    ref = _mlp_and_grads(_fp8_up_matmuls(False).relu2_mlp, *operands)
    for name, g, r in zip(("y", "dx", "dw_up", "dw_down"), got, ref):
        assert g.dtype == r.dtype == torch.bfloat16, name
        assert _max_rel(g, r) < 2e-2, f"{name}: {_max_rel(g, r)}"
    assert stand_in.operand_dtypes == [(torch.float8_e4m3fn, torch.float8_e4m3fn)]
    bf16 = _mlp_and_grads(PlainMatmuls().relu2_mlp, *operands)
    assert _max_rel(got[0], bf16[0]) > 2 * _max_rel(got[0], ref[0])


def test_fp8_up_refusals_name_the_fix(stand_in, tmp_path):
    """Every pairing that would run an MLP site in another precision than configured is refused:
    the fused MLP on the plain strategy with fp8 sites, fp8 sites that differ from the fused
    MLP's, an fp8 MLP backward (the fused one is bf16), dims that _scaled_mm cannot take; the
    config refuses mlp_down and the fp8 backward beside --mlp-kernel quack (exit 2)."""
    fn, label = relu2_mlp.quack_relu2_mlp_fp8_up, relu2_mlp.QUACK_MLP_FP8_UP_LABEL
    with pytest.raises(ValueError, match="needs the fp8 strategy"):
        PlainMatmuls().use_fused_mlp(fn, label, fp8_sites=("mlp_up",))
    with pytest.raises(ValueError, match="need model.fp8.mlp_backward=bf16"):
        _fp8_up_matmuls(False, mlp_backward="fp8").use_fused_mlp(fn, label, fp8_sites=("mlp_up",))
    with pytest.raises(ValueError, match=r"runs the fp8 MLP sites \[\]: it cannot take the fp8 sites \['mlp_up'\]"):
        _fp8_up_matmuls(False).use_fused_mlp(relu2_mlp.quack_relu2_mlp, relu2_mlp.QUACK_MLP_LABEL)
    x, w_up, w_down, _ = _bf16_operands(t=40)
    with pytest.raises(ValueError, match=r"quack_relu2_mlp_fp8_up: T, D, F = \(40, 32, 96\)"):
        _fp8_up_matmuls(True).relu2_mlp(x, w_up, w_down, layer=0)
    base = ["--preset", "small-gpu", "--data-dir", str(tmp_path), "--mlp-kernel", "quack", "--fp8"]
    for extra in (["--set", "model.fp8.sites=lm_head,mlp_up"],
                  ["--set", "model.fp8.sites=mlp_up,mlp_down", "--set", "model.fp8.mlp_backward=bf16"]):
        with pytest.raises(SystemExit) as e:
            config.parse(base + extra)
        assert e.value.code == 2, extra
    cfg = config.parse(base + ["--set", "model.fp8.sites=lm_head,mlp_up",
                               "--set", "model.fp8.mlp_backward=bf16"])
    assert cfg.model.fp8.sites == ("lm_head", "mlp_up")


def test_the_install_picks_the_fp8_up_mlp_where_mlp_up_is_fp8(stand_in, monkeypatch):
    """_install_mlp_kernel: with "mlp_up" among the active fp8 sites the fp8-up quack MLP, named
    in the strategies line; with the lm head alone the bf16 one (the test above this one)."""
    from track_1_short.trainer import build

    monkeypatch.setattr(relu2_mlp, "quack_unavailable_reason", lambda device: None)
    model = _model()
    model.config.fp8 = Fp8Config(enabled=True, sites=("lm_head", "mlp_up"), mlp_backward="bf16")
    model.matmuls = fp8 = _fp8_up_matmuls(False)
    build._install_mlp_kernel(model, torch.device("cpu"), "quack")
    assert model.matmuls is fp8 and fp8.fused_mlp is relu2_mlp.quack_relu2_mlp_fp8_up
    assert "the up projection in fp8" in build.describe_strategies(model)
