"""The ReLU^2 MLP with the activation in the GEMM epilogues, from quack-kernels (CuTe DSL GEMMs
for SM90 / SM100): TrainConfig.mlp_kernel = "quack".

What it replaces: PlainMatmuls.relu2_mlp's three kernels per direction (model/fp8.py: the up
GEMM, relu().square() as an elementwise kernel, the down GEMM; in the backward the down GEMM's
input gradient, the ReLU^2 derivative elementwise, then the up GEMM's gradients). At stage C the
elementwise kernels cost ~31 ms per step of 8 micro-steps on one H200 (docs/results/README.md,
2026-12-01 sixth lease): each reads and writes a [T, 3072] bf16 tensor per layer.

Math (the same as PlainMatmuls.relu2_mlp, the reference; x [T, D], w_up [F, D] out x in, w_down
[F, D] in x out):
    forward   pre = x @ w_up^T, post = relu(pre)^2  (one gemm_act, relu_sq epilogue: saves pre)
              y = post @ w_down                      (cuBLAS)
    backward  d_pre = (dy @ w_down^T) * 2 relu(pre), post again (one gemm_dact epilogue)
              dw_down = post^T @ dy, dx = d_pre @ w_up, dw_up = d_pre^T @ x   (cuBLAS)
With the up projection in fp8 (`quack_relu2_mlp_fp8_up`: model.fp8.sites holding "mlp_up" beside
--mlp-kernel quack, with model.fp8.mlp_backward=bf16), as HEAD's MLP (facts 1.7) but with the
ReLU^2 kept in quack's epilogue:
    forward   x8 = q4(x / x_s), w8 = q4(w_up / w_s)   (e4m3, current amax scales: model/fp8.py's
              amax_scale / quantise, the "mlp_up" site's definition)
              pre = (x8 @ w8^T) * x_s w_s, post = relu(pre)^2  (one fp8 gemm_act, alpha = x_s w_s
              read from the device)
              y = post @ w_down                      (cuBLAS, bf16)
    backward  the same bf16 backward as above from the saved bf16 x, w_up, w_down and the
              dequantised pre: what Fp8Matmuls gives the unfused "mlp_up" site with
              mlp_backward "bf16" (fp8_forward_matmul), its reference here.
The down projection stays bf16 (HEAD's is fp8 with delayed scales from per-SM amaxes in its up
kernel's epilogue; here a current amax of post would read the [T, F] tensor twice more per layer,
more than an fp8 GEMM saves).
Speed (one H200, stage C, 8 micro-steps, docs/results/step_variants_h200_2026-12-02b_C.json):
the fp8 up projection made the step slower, 642.9 against 611.2 ms with the bf16 one (1.052x;
predicted 0.988x): quack's fp8 gemm_act took 67.8 ms per step against 28.4 ms for its bf16
gemm_act (2.4x, with another MMA tile in its kernel name), plus 3.3 ms of amax and quantise.
Why quack picks that kernel was not traced; no default uses this path.
The quack calls sit inside our own torch custom ops (`track_1_short::relu2_up`,
`track_1_short::relu2_up_fp8`, `track_1_short::relu2_down_dgrad`, fake-registered), so torch.compile(fullgraph=True) traces only
the autograd.Function around them and never quack's Python; quack allocates with torch.empty
(capture-safe) and autotunes per shape at its first call, which the step graphs' warm
iterations make before any capture (QUACK_CACHE_AUTOTUNING=1 and QUACK_CACHE_DIR keep the
choices on disk for the next run; scripts/gpu/common.sh sets both).

`_quack()` is the one place the library is imported (through kernels/quack_lib.py; flash-attn-4's dependency; on the H200 hosts
scripts/gpu/fa4_wheels.sh carries both); the CPU tests replace it with torch stand-ins to check
the plumbing. The kernels: tests/test_relu2_mlp_gpu.py on the H200.

Legend: T tokens, D model dim, F MLP hidden.
"""

import torch
from torch import Tensor

from track_1_short.kernels.quack_lib import import_gemm_interface
from track_1_short.model.attention_fa4 import cute_dsl_unavailable_reason
from track_1_short.model.fp8 import E4M3, amax_scale, check_fp8_dims, quantise



_lib = None  # quack.gemm_interface once imported (the CPU tests set a stand-in)


def _quack():
    """quack.gemm_interface, or ImportError naming the package (imported once;
    quack_unavailable_reason calls it, so the trainer's install fails there, naming the package)."""
    global _lib
    if _lib is None:
        _lib = import_gemm_interface("TrainConfig.mlp_kernel='quack'")
    return _lib


def quack_unavailable_reason(device: torch.device) -> str | None:
    """None when the quack MLP can run on `device`, else why not."""
    return cute_dsl_unavailable_reason(device, _quack)


@torch.library.custom_op("track_1_short::relu2_up", mutates_args=())
def _relu2_up(x: Tensor, w_up: Tensor) -> tuple[Tensor, Tensor]:
    """pre = x @ w_up^T, post = relu(pre)^2: one gemm_act with the relu_sq epilogue."""
    pre, post = _quack().gemm_act(x, w_up.t(), activation="relu_sq", store_preact=True)
    return pre, post  # [T, F] each


@_relu2_up.register_fake
def _relu2_up_fake(x, w_up):
    shape = (x.shape[0], w_up.shape[0])
    return x.new_empty(shape), x.new_empty(shape)


@torch.library.custom_op("track_1_short::relu2_up_fp8", mutates_args=())
def _relu2_up_fp8(x8: Tensor, w8: Tensor, alpha: Tensor) -> tuple[Tensor, Tensor]:
    """pre = (x8 @ w8^T) * alpha in bf16, post = relu(pre)^2: one fp8 gemm_act (relu_sq epilogue,
    alpha [1] float32 read from the device). x8 [T, D], w8 [F, D] e4m3 row-major (both K-major,
    the only fp8 layout quack's SM90 GEMM takes)."""
    pre, post = _quack().gemm_act(x8, w8.t(), activation="relu_sq", alpha=alpha, store_preact=True,
                                  out_dtype=torch.bfloat16, postact_dtype=torch.bfloat16)
    return pre, post  # [T, F] each


@_relu2_up_fp8.register_fake
def _relu2_up_fp8_fake(x8, w8, alpha):
    shape = (x8.shape[0], w8.shape[0])
    return x8.new_empty(shape, dtype=torch.bfloat16), x8.new_empty(shape, dtype=torch.bfloat16)


def _up_fp8(x: Tensor, w_up: Tensor) -> tuple[Tensor, Tensor]:
    """The fp8 up projection (module docstring): x [T, D], w_up [F, D] -> pre, post [T, F] bf16,
    quantised with the current amax scales of the "mlp_up" site (traced code: inductor fuses the
    quantisation into the kernels that produce x)."""
    x_s, w_s = amax_scale(x, E4M3), amax_scale(w_up, E4M3)
    alpha = (x_s * w_s).reshape(1)  # [1]: quack's tensor alpha
    return _relu2_up_fp8(quantise(x, x_s, E4M3), quantise(w_up, w_s, E4M3), alpha)


@torch.library.custom_op("track_1_short::relu2_down_dgrad", mutates_args=())
def _relu2_down_dgrad(dy: Tensor, w_down: Tensor, pre: Tensor) -> tuple[Tensor, Tensor]:
    """d_pre = (dy @ w_down^T) * 2 relu(pre) and post again: one gemm_dact (relu_sq)."""
    d_pre, post = _quack().gemm_dact(dy, w_down.t(), pre, activation="relu_sq")
    return d_pre, post  # [T, F] each


@_relu2_down_dgrad.register_fake
def _relu2_down_dgrad_fake(dy, w_down, pre):
    return torch.empty_like(pre), torch.empty_like(pre)


class _Relu2Mlp(torch.autograd.Function):
    """Autograd over the two ops (quack's Python stays inside them: dynamo traces only this)."""

    @staticmethod
    def forward(ctx, x: Tensor, w_up: Tensor, w_down: Tensor, fp8_up: bool) -> Tensor:
        pre, post = _up_fp8(x, w_up) if fp8_up else _relu2_up(x, w_up)  # [T, F] each
        ctx.save_for_backward(x, w_up, w_down, pre)
        return post.to(w_down.dtype) @ w_down  # [T, D]

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, w_up, w_down, pre = ctx.saved_tensors
        d_pre, post = _relu2_down_dgrad(dy.contiguous(), w_down, pre.to(w_down.dtype))  # [T, F]
        dx = d_pre @ w_up  # [T, D]
        dw_up = d_pre.t() @ x  # [F, D]
        dw_down = post.t() @ dy  # [F, D]
        return dx, dw_up, dw_down, None


QUACK_MLP_LABEL = "quack GEMMs with ReLU^2 in the epilogues (kernels/relu2_mlp.py)"
QUACK_MLP_FP8_UP_LABEL = ("quack GEMMs with ReLU^2 in the epilogues, the up projection in fp8 "
                          "(kernels/relu2_mlp.py)")


def quack_relu2_mlp(x: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
    """The fused MLP: x [T, D], w_up [F, D], w_down [F, D] -> [T, D], with autograd; the math of
    PlainMatmuls.relu2_mlp. The trainer gives it to the installed matmul strategy
    (`matmuls.use_fused_mlp(quack_relu2_mlp, QUACK_MLP_LABEL)`, trainer/build.py), so the lm
    head keeps that strategy's matmul (e.g. fp8); eval keeps PlainMatmuls."""
    return _Relu2Mlp.apply(x.contiguous(), w_up.contiguous(), w_down.contiguous(), False)


def quack_relu2_mlp_fp8_up(x: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
    """quack_relu2_mlp with the up projection in fp8 (module docstring): the same contract; D and
    F multiples of 16 and T too (ValueError naming them otherwise). Its reference is the unfused
    fp8 "mlp_up" site with mlp_backward "bf16" (Fp8Matmuls.relu2_mlp); the trainer installs it
    with `use_fused_mlp(..., fp8_sites=("mlp_up",))`."""
    check_fp8_dims("quack_relu2_mlp_fp8_up", x, w_up.t(), "T, D, F",
                   "pad the batch or drop mlp_up from model.fp8.sites")
    return _Relu2Mlp.apply(x.contiguous(), w_up.contiguous(), w_down.contiguous(), True)
