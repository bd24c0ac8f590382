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
Both quack calls sit inside our own torch custom ops (`track_1_short::relu2_up`,
`track_1_short::relu2_down_dgrad`, fake-registered), so torch.compile(fullgraph=True) traces only
the autograd.Function around them and never quack's Python; quack allocates with torch.empty
(capture-safe) and autotunes per shape at its first call, which the step graphs' warm
iterations make before any capture (QUACK_CACHE_AUTOTUNING=1 and QUACK_CACHE_DIR keep the
choices on disk for the next run; scripts/gpu/common.sh sets both).

`_quack()` is the one place the library is imported (flash-attn-4's dependency; on the H200 hosts
scripts/gpu/fa4_wheels.sh carries both); the CPU tests replace it with torch stand-ins to check
the plumbing. The kernels: tests/test_relu2_mlp_gpu.py on the H200.

Legend: T tokens, D model dim, F MLP hidden.
"""

import importlib

import torch
from torch import Tensor

from track_1_short.model.attention_fa4 import cute_dsl_unavailable_reason

QUACK_HINT = ("pip install quack-kernels (with nvidia-cutlass-dsl-libs-cu13 for CUDA 13); on a host "
              "without a registry: scripts/gpu/fa4_wheels.sh here, fa4_install.sh there, then "
              "source .fa4_site/ENV")


_lib = None  # quack.gemm_interface once imported (the CPU tests set a stand-in)


def _quack():
    """quack.gemm_interface, or ImportError naming the package (imported once;
    quack_unavailable_reason calls it, so the trainer's install fails there, naming the package)."""
    global _lib
    if _lib is None:
        try:
            _lib = importlib.import_module("quack.gemm_interface")
        except ImportError as e:
            raise ImportError(f"TrainConfig.mlp_kernel='quack' needs quack-kernels ({e}); "
                              f"{QUACK_HINT}") from e
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
    def forward(ctx, x: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
        pre, post = _relu2_up(x, w_up)  # [T, F] each
        ctx.save_for_backward(x, w_up, w_down, pre)
        return post @ w_down  # [T, D]

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, w_up, w_down, pre = ctx.saved_tensors
        d_pre, post = _relu2_down_dgrad(dy.contiguous(), w_down, pre)  # [T, F] each
        dx = d_pre @ w_up  # [T, D]
        dw_up = d_pre.t() @ x  # [F, D]
        dw_down = post.t() @ dy  # [F, D]
        return dx, dw_up, dw_down


QUACK_MLP_LABEL = "quack GEMMs with ReLU^2 in the epilogues (kernels/relu2_mlp.py)"


def quack_relu2_mlp(x: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
    """The fused MLP: x [T, D], w_up [F, D], w_down [F, D] -> [T, D], with autograd; the math of
    PlainMatmuls.relu2_mlp. The trainer gives it to the installed matmul strategy
    (`matmuls.use_fused_mlp(quack_relu2_mlp, QUACK_MLP_LABEL)`, trainer/build.py), so the lm
    head keeps that strategy's matmul (e.g. fp8); eval keeps PlainMatmuls."""
    return _Relu2Mlp.apply(x.contiguous(), w_up.contiguous(), w_down.contiguous())
