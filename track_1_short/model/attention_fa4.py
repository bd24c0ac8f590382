"""Attention backend "fa4": FlashAttention 4 (the `flash-attn-4` package, CuTe DSL kernels for
SM90 and SM100) varlen, causal, sliding window, as two torch custom ops so that
torch.compile(fullgraph=True) keeps it in one graph and a CUDA graph can capture its launches.

What it replaces: HEAD modded-nanogpt's FA3 varlen call from the `kernels` hub (facts 1.4), which
is not installable here, and our FlexAttention backend where this one is faster and passes the
step graphs' self-check: at stage C on one H200 our step took 679.6 ms with it and 722.0 ms with
FlexAttention, graphs on and self-checked (scripts/gpu/fp8_step.sh's fa4 variant,
docs/results/step_variants_h200_2026-12-01_C.json); stage A and loss not measured yet.

Semantics: those of model/attention.py (query i attends key j iff j <= i, i - j <= window, same
document of cum_seqlens): FA's window_size = (window, 0), causal. cum_seqlens int32 [C] padded
with T is passed as is (the padding entries are zero-length documents, as in HEAD's call).

The ops (`track_1_short::fa4_fwd`, `track_1_short::fa4_bwd`): the forward returns the output and
the log-sum-exp [H, T] float32 that the backward needs; the backward returns dq, dk, dv. Both
have fake implementations (shapes only), so inductor traces them without running the kernels;
the kernels compile (CuTe DSL JIT, cached per shape and window by flash-attn-4) at their first
real call, which the trainer's warmup makes before any capture. Each (shape, window, direction)
is its own compile; FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 and FLASH_ATTENTION_CUTE_DSL_CACHE_DIR
keep them on disk for the next run (scripts/gpu/common.sh sets both).

`_interface()` is the one place the library is imported; the CPU tests replace it with a torch
stand-in to check the ops' plumbing (argument mapping, autograd, fullgraph compile). The kernels
themselves are checked on the GPU (tests/test_attention_gpu.py).

Legend: T tokens, H heads, D head_dim, C cum_seqlens entries.
"""

import importlib

import torch
from torch import Tensor

PACKAGE_HINT = ("pip install flash-attn-4 (with nvidia-cutlass-dsl-libs-cu13 for CUDA 13); on a "
                "host without a registry: scripts/gpu/fa4_wheels.sh here, fa4_install.sh there, "
                "then source .fa4_site/ENV")


def _interface():
    """flash_attn.cute.interface, or ImportError naming the package."""
    try:
        return importlib.import_module("flash_attn.cute.interface")
    except ImportError as e:
        raise ImportError(f"attention backend 'fa4' needs flash-attn-4 ({e}); {PACKAGE_HINT}") from e


def cute_dsl_unavailable_reason(device: torch.device, load) -> str | None:
    """Why a CuTe DSL kernel library (flash-attn-4, quack-kernels: SM90 / SM100 kernels) cannot
    run on `device`, None when it can; `load()` imports the library (an ImportError naming the
    package becomes the reason)."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return "needs CUDA"
    major = torch.cuda.get_device_capability(device)[0]
    if major not in (9, 10):
        return f"needs compute capability 9.x or 10.x, this GPU has {major}.x"
    try:
        load()
    except ImportError as e:
        return str(e)
    return None


def fa4_unavailable_reason(device: torch.device) -> str | None:
    """Why the fa4 backend cannot run on `device` (None: it can)."""
    return cute_dsl_unavailable_reason(device, _interface)


@torch.library.custom_op("track_1_short::fa4_fwd", mutates_args=())
def _fa4_fwd(q: Tensor, k: Tensor, v: Tensor, cum_seqlens: Tensor, max_seqlen: int, window: int,
             scale: float) -> tuple[Tensor, Tensor]:
    out, lse, *_ = _interface()._flash_attn_fwd(
        q, k, v, cu_seqlens_q=cum_seqlens, cu_seqlens_k=cum_seqlens, max_seqlen_q=max_seqlen,
        max_seqlen_k=max_seqlen, softmax_scale=scale, causal=True, window_size_left=window,
        window_size_right=0, return_lse=True)
    return out, lse  # [T, H, D], [H, T] float32


@_fa4_fwd.register_fake
def _fa4_fwd_fake(q, k, v, cum_seqlens, max_seqlen, window, scale):
    t, h, _ = q.shape
    return torch.empty_like(q), q.new_empty((h, t), dtype=torch.float32)


@torch.library.custom_op("track_1_short::fa4_bwd", mutates_args=())
def _fa4_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
             cum_seqlens: Tensor, max_seqlen: int, window: int,
             scale: float) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = _interface()._flash_attn_bwd(
        q, k, v, out, dout, lse, scale, True, 0.0, window_size_left=window, window_size_right=0,
        cu_seqlens_q=cum_seqlens, cu_seqlens_k=cum_seqlens, max_seqlen_q=max_seqlen,
        max_seqlen_k=max_seqlen)[:3]
    return dq, dk, dv


@_fa4_bwd.register_fake
def _fa4_bwd_fake(dout, q, k, v, out, lse, cum_seqlens, max_seqlen, window, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, cum_seqlens, max_seqlen, window, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cum_seqlens)
    ctx.args = (max_seqlen, window, scale)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cum_seqlens = ctx.saved_tensors
    dq, dk, dv = _fa4_bwd(dout.contiguous(), q, k, v, out, lse, cum_seqlens, *ctx.args)
    return dq, dk, dv, None, None, None, None


_fa4_fwd.register_autograd(_backward, setup_context=_setup_context)


def fa4_attention(q: Tensor, k: Tensor, v: Tensor, cum_seqlens: Tensor, max_seqlen: int,
                  window: int, scale: float) -> Tensor:
    """q, k, v [T, H, D] bf16 -> [T, H, D]; model/attention.py's semantics."""
    out, _ = _fa4_fwd(q.contiguous(), k.contiguous(), v.contiguous(), cum_seqlens.to(torch.int32),
                      max_seqlen, window, scale)
    return out
