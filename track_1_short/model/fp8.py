"""fp8 matmuls (torch._scaled_mm) for the lm head and the MLP down projection, with address-stable
scale buffers.

What it replaces: the bf16 GEMMs `x @ lm_head` and `relu(.)^2 @ c_proj` of GPT.forward's training
path (eval_ce never uses fp8). Why faster: Hopper's fp8 tensor cores have twice the dense bf16 peak
(H100/H200 SXM ~1979 vs ~989 TFLOP/s) and the operands are half the bytes; the lm head GEMM
[T, 768] x [768, 50304] is the step's largest. Correctness is GPU-tested (tests/test_fp8_gpu.py
passed on the H200, 2026-11-30: op vs reference and bf16 at the speedrun shapes, compiled, captured
and replayed, tiny GPT fp8 vs bf16); speed is not measured yet (TODO(model owner): bench/model.py
with and without --fp8), so Fp8Config.enabled defaults to False.

The op (one definition, shared by eager, torch.compile and CUDA-graph capture):
    forward   x8 = q4(x / x_s), w8 = q4(w / w_s)      (e4m3, [T, K] and [K, N])
              out = _scaled_mm(x8, w8, x_s, w_s) -> bf16 [T, N], fast accumulation
    backward  g8 = q5(g / grad_s)                     (e5m2, [T, N])
              grad_x = _scaled_mm(g8, w8^T, grad_s, w_s) -> bf16 [T, K]
              grad_w = _scaled_mm(x8^T, g8, x_s, grad_s) -> fp32 [K, N], then w's dtype
where q clamps to the format's finite range (+-448 e4m3, +-57344 e5m2: an out-of-range cast would
give NaN/inf) and rounds to nearest; `quantise` is that one definition, used by the op and by the
slow references `fp8_matmul_reference` / `fp8_matmul_backward_reference`. _scaled_mm returns
(A8 @ B8) * scale_a * scale_b, so the scales are dequantisation scales (value = fp8 * scale).
Both directions are torch.library custom ops (`t1s::fp8_mm`, `t1s::fp8_mm_backward`, fake +
autograd registered): dynamo traces them without a graph break and inductor runs them as opaque
extern kernels, so it cannot change the operand layouts cuBLASLt needs; their bodies are eager
device ops with no host sync and no host-dependent allocation, so they are CUDA-graph capturable.
x8 and w8 are op outputs saved for the backward (fp8: half the bytes of saving bf16 x and w).

_scaled_mm layout rules (CUDA; torch's meta function checks them, so tests/test_fp8.py runs the op
bodies on fake CUDA tensors on the CPU machine): the first operand row-major (strides (K, 1)), the
second column-major (strides (1, K)); K and both dims of the second operand multiples of 16. Hence
T, K and N must all be multiples of 16 (grad_w contracts over T); `fp8_matmul` raises otherwise.
Layouts used: x8 [T, K] row-major; w8 [K, N] row-major, passed forward as `_col_major(w8)` (a
transposed copy `.t().clone(contiguous).t()`) and backward as `w8.t()` (already column-major
[N, K]); grad_w gets `_row_major(x8.t())` [K, T] and `_col_major(g8)`. (`.clone(memory_format=
torch.contiguous_format)` rather than `.contiguous()`: the latter fails on fake CUDA tensors in the
CPU build, and the copy is needed anyway.) The CPU _scaled_mm ignores layouts and fast accumulation.

Scales: lm head STATIC (facts 1.7): x_s = 100/448, w_s = 1.6/448, grad_s = 0.75/448, registered
buffers. MLP down CURRENT per-tensor amax: x_s = amax|x|/448, w_s = amax|w|/448 computed in the
traced forward, grad_s = amax|g|/57344 inside the backward op; all on device (no host sync), amax
floored at AMAX_FLOOR so an all-zero tensor (c_proj is zero at init) quantises to zeros, not NaN.

What must stay address-stable: every persistent scale is a registered float32 0-d buffer in ITS
OWN storage (cuBLASLt on torch 2.11+cu130 refused `_scaled_mm` scales at a 4-byte offset inside a
larger buffer, CUBLAS_STATUS_NOT_SUPPORTED, DESIGN.md section 4; the op raises on an offset scale),
updated in place only; reset() restores them in place. Python values the compiled forward
specializes on: `active` and the `which` argument. Call order: built by GPT; `resolve(device)` once
by the trainer after .to(device) (warns when fp8 was asked for and cannot run); `matmul` inside the
forward.

Provenance: HEAD modded-nanogpt (facts 1.7): lm head static scales, fast-accumulation forward,
fp32 grad_w, e5m2 gradients (the `mm_op` custom op, train_gpt.py:70-162, and
FusedSoftcappedCrossEntropy, triton_kernels.py:1210-1292).
Deviations from HEAD:
- MLP down: current per-tensor amax scales instead of HEAD's delayed per-layer scales (activations
  amax*1.80/448 from the previous step, weights previous amax*1.12/448, exact "bootstrap" scales in
  warmup, after reset and for steps < 16): no state and no reset rules, for one extra amax
  reduction per operand.
- MLP down backward is fp8 (e5m2 gradient); HEAD keeps the whole MLP backward in bf16.
  TODO(model owner): compare validation loss with HEAD's choice once the GPU path is validated.
- MLP up projection stays bf16 (HEAD: fp8 with a cached per-layer fp8 weight copy).
- Quantisation and the transposed copies run as eager kernels inside the ops (a few memory passes
  over x, w and g) instead of HEAD's fused Triton quantise+transpose kernels.
- lm head grad_s = 0.75/448 without HEAD's grad_scale (= 1/grad_accum) factor: on one GPU the
  trainer's 1/micro_steps loss scale shifts the gradients 3 octaves down inside e5m2's range
  (normals from 2^-14) instead of rescaling them.

Legend: T tokens, K inner dim, N output dim.
"""

import warnings
from dataclasses import dataclass

import torch
from torch import Tensor, nn

E4M3 = torch.float8_e4m3fn  # forward operands
E5M2 = torch.float8_e5m2  # gradients
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}  # largest finite value of each format
E4M3_MAX = FP8_MAX[E4M3]
LM_HEAD_X_SCALE = 100.0 / E4M3_MAX  # facts 1.7
LM_HEAD_W_SCALE = 1.6 / E4M3_MAX
LM_HEAD_GRAD_SCALE = 0.75 / E4M3_MAX
AMAX_FLOOR = 1e-12  # current-amax scales: max|t| is floored here (all-zero tensors)
MIN_CAPABILITY = (8, 9)  # fp8 tensor cores: Ada (8.9) and Hopper (9.0: H100/H200)
SITES = ("lm_head", "mlp_down")  # Fp8Matmuls.matmul(which=...)
DIM_MULTIPLE = 16  # _scaled_mm: T, K and N multiples of 16 (see module docstring)


@dataclass(slots=True, kw_only=True)
class Fp8Config:
    enabled: bool = False  # fp8 lm head + MLP down on CUDA >= 8.9; off until GPU-validated; --no-fp8


# ---- quantisation (one definition for the op and the references) ----

def quantise(t: Tensor, scale: Tensor | float, dtype: torch.dtype) -> Tensor:
    """t / scale clamped to +-FP8_MAX[dtype] and rounded to `dtype` (no autograd). The division
    runs in float32 so the result does not depend on t's dtype. Same strides as t when t is dense."""
    fmax = FP8_MAX[dtype]
    q = t.detach().to(torch.float32, copy=True)  # own buffer: the in-place ops below leave t alone
    q.div_(scale).clamp_(-fmax, fmax)
    return q.to(dtype)


def dequantise(t8: Tensor, scale: Tensor | float) -> Tensor:
    """float32 values of an fp8 tensor quantised with `scale`."""
    return t8.to(torch.float32) * scale


def amax_scale(t: Tensor, dtype: torch.dtype) -> Tensor:
    """Current per-tensor scale max|t| / FP8_MAX[dtype]: float32 0-d on t's device, in its own
    storage, no host sync. max|t| is floored at AMAX_FLOOR so zeros quantise to zeros."""
    amax = torch.linalg.vector_norm(t.detach(), ord=float("inf"), dtype=torch.float32)
    return amax.clamp_min(AMAX_FLOOR) / FP8_MAX[dtype]


def fp8_matmul_reference(x: Tensor, w: Tensor, x_s: Tensor | float, w_s: Tensor | float) -> Tensor:
    """Slow reference of the op's forward: dequantised e4m3 operands, float32 matmul, bf16 result.
    x [T, K], w [K, N] -> bf16 [T, N]. Any device, any float dtype."""
    xq = dequantise(quantise(x, x_s, E4M3), x_s)  # [T, K]
    wq = dequantise(quantise(w, w_s, E4M3), w_s)  # [K, N]
    return (xq @ wq).to(torch.bfloat16)


def fp8_matmul_backward_reference(g: Tensor, x: Tensor, w: Tensor, x_s: Tensor | float,
                                  w_s: Tensor | float, grad_s: Tensor | float | None
                                  ) -> tuple[Tensor, Tensor]:
    """Slow reference of the op's backward: (grad_x bf16 [T, K], grad_w float32 [K, N]) from the
    output gradient g [T, N] quantised to e5m2 (grad_s None: current amax scale of g)."""
    g_s = amax_scale(g, E5M2) if grad_s is None else grad_s
    gq = dequantise(quantise(g, g_s, E5M2), g_s)  # [T, N]
    xq = dequantise(quantise(x, x_s, E4M3), x_s)  # [T, K]
    wq = dequantise(quantise(w, w_s, E4M3), w_s)  # [K, N]
    return (gq @ wq.t()).to(torch.bfloat16), xq.t() @ gq


# ---- the custom ops ----

def _row_major(t: Tensor) -> Tensor:
    """[R, C] with strides (C, 1): t itself when already so, else a copy."""
    return t if t.is_contiguous() else t.clone(memory_format=torch.contiguous_format)


def _col_major(t: Tensor) -> Tensor:
    """[R, C] with strides (1, R) (a transposed copy unless t already is column-major)."""
    return _row_major(t.t()).t()


def _check_scale(s: Tensor, name: str):
    # Raised here, not left to cuBLASLt: an offset scale failed with CUBLAS_STATUS_NOT_SUPPORTED.
    if s.dtype != torch.float32 or s.dim() != 0 or s.storage_offset() != 0:
        raise ValueError(f"fp8 scale {name}: needs a float32 0-d tensor in its own storage "
                         f"(dtype {s.dtype}, dim {s.dim()}, storage offset {s.storage_offset()})")


def fp8_mm_forward(x: Tensor, w: Tensor, x_s: Tensor, w_s: Tensor,
                   grad_s: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Body of t1s::fp8_mm: (out bf16 [T, N], x8 e4m3 [T, K] row-major, w8 e4m3 [K, N] row-major).
    grad_s is only carried to the backward (None: current amax of the gradient)."""
    _check_scale(x_s, "x_s")
    _check_scale(w_s, "w_s")
    x8 = _row_major(quantise(x, x_s, E4M3))  # [T, K]
    w8 = _row_major(quantise(w, w_s, E4M3))  # [K, N]; w8.t() is the backward's column-major operand
    out = torch._scaled_mm(x8, _col_major(w8), x_s, w_s, out_dtype=torch.bfloat16,
                           use_fast_accum=True)  # [T, N]
    return out, x8, w8


def fp8_mm_backward(g: Tensor, x8: Tensor, w8: Tensor, x_s: Tensor, w_s: Tensor,
                    grad_s: Tensor | None) -> tuple[Tensor, Tensor]:
    """Body of t1s::fp8_mm_backward: (grad_x bf16 [T, K], grad_w float32 [K, N]) from the output
    gradient g [T, N] and the forward's x8 [T, K], w8 [K, N] (both row-major)."""
    g_s = amax_scale(g, E5M2) if grad_s is None else grad_s
    _check_scale(g_s, "grad_s")
    g8 = _row_major(quantise(g, g_s, E5M2))  # [T, N]
    # HEAD's choice: exact (non-fast) accumulation for both gradient GEMMs
    grad_x = torch._scaled_mm(g8, w8.t(), g_s, w_s, out_dtype=torch.bfloat16,
                              use_fast_accum=False)  # [T, N] @ [N, K] -> [T, K]
    grad_w = torch._scaled_mm(_row_major(x8.t()), _col_major(g8), x_s, g_s,
                              out_dtype=torch.float32, use_fast_accum=False)  # [K, T] @ [T, N]
    return grad_x, grad_w


_fp8_mm = torch.library.custom_op("t1s::fp8_mm", fp8_mm_forward, mutates_args=())
_fp8_mm_backward = torch.library.custom_op("t1s::fp8_mm_backward", fp8_mm_backward, mutates_args=())


@_fp8_mm.register_fake
def _fp8_mm_fake(x, w, x_s, w_s, grad_s):
    (t, k), n = x.shape, w.shape[1]
    return (x.new_empty((t, n), dtype=torch.bfloat16), x.new_empty((t, k), dtype=E4M3),
            w.new_empty((k, n), dtype=E4M3))


@_fp8_mm_backward.register_fake
def _fp8_mm_backward_fake(g, x8, w8, x_s, w_s, grad_s):
    (t, n), k = g.shape, x8.shape[1]
    return g.new_empty((t, k), dtype=torch.bfloat16), g.new_empty((k, n), dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    x, w, x_s, w_s, grad_s = inputs
    _, x8, w8 = output
    ctx.mark_non_differentiable(x8, w8)
    ctx.save_for_backward(x8, w8, x_s, w_s, grad_s)
    ctx.dtypes = (x.dtype, w.dtype)


def _backward(ctx, grad_out, _grad_x8, _grad_w8):
    x8, w8, x_s, w_s, grad_s = ctx.saved_tensors
    grad_x, grad_w = _fp8_mm_backward(grad_out, x8, w8, x_s, w_s, grad_s)
    return grad_x.to(ctx.dtypes[0]), grad_w.to(ctx.dtypes[1]), None, None, None


_fp8_mm.register_autograd(_backward, setup_context=_setup_context)


def fp8_matmul(x: Tensor, w: Tensor, x_s: Tensor, w_s: Tensor,
               grad_s: Tensor | None = None) -> Tensor:
    """x [T, K] @ w [K, N] -> bf16 [T, N] through t1s::fp8_mm (differentiable in x and w). Scales
    are float32 0-d tensors on x's device in their own storage; grad_s None = current amax of the
    gradient. T, K, N must be multiples of 16 (ValueError otherwise)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"fp8_matmul: x [T, K] @ w [K, N] expected, got {tuple(x.shape)} @ {tuple(w.shape)}")
    dims = (x.shape[0], x.shape[1], w.shape[1])
    if any(d % DIM_MULTIPLE for d in dims):
        raise ValueError(f"fp8_matmul: T, K, N = {dims} must be multiples of {DIM_MULTIPLE} "
                         "(torch._scaled_mm); pad the batch or run with --no-fp8")
    return _fp8_mm(x, w, x_s, w_s, grad_s)[0]


def fp8_unavailable_reason(device: torch.device) -> str | None:
    """Why fp8 matmuls cannot run on `device` (None: they can)."""
    if device.type != "cuda":
        return "not a CUDA device"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < MIN_CAPABILITY:
        return (f"compute capability {major}.{minor} < {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} "
                "(no fp8 tensor cores for torch._scaled_mm)")
    return None


class Fp8Matmuls(nn.Module):
    """The lm head's static scale buffers and the matmul that picks fp8 or bf16 per call site."""

    def __init__(self, cfg: Fp8Config):
        super().__init__()
        self.cfg = cfg
        self.active = False  # set by resolve(); False = bf16/fp32 path
        self.initial = {"lm_head_x_scale": LM_HEAD_X_SCALE, "lm_head_w_scale": LM_HEAD_W_SCALE,
                        "lm_head_grad_scale": LM_HEAD_GRAD_SCALE}
        for name, value in self.initial.items():
            # one registration = one allocation: each scale has its own aligned storage
            self.register_buffer(name, torch.tensor(value, dtype=torch.float32))

    def resolve(self, device: torch.device) -> bool:
        """Whether fp8 runs on `device` (enabled, CUDA, capability >= 8.9); warns, naming the device
        and the reason, when it was asked for but cannot run. Call after .to(device)."""
        device = torch.device(device)
        reason = fp8_unavailable_reason(device) if self.cfg.enabled else None
        if reason is not None:
            warnings.warn(f"Fp8Config.enabled=True but fp8 matmuls cannot run on {device}: {reason}; "
                          "running bf16 matmuls", stacklevel=2)
        self.active = self.cfg.enabled and reason is None
        if self.active and self.lm_head_x_scale.device.type != device.type:
            raise ValueError(f"Fp8Matmuls.resolve({device}): scale buffers are on "
                             f"{self.lm_head_x_scale.device}; call resolve after model.to(device)")
        return self.active

    def matmul(self, x: Tensor, w: Tensor, which: str) -> Tensor:
        """x [T, K] @ w [K, N] -> [T, N] in x's dtype. Active: fp8 with the scales of call site
        `which` ("lm_head": static, "mlp_down": current amax); else x @ w in x's dtype."""
        if which not in SITES:
            raise ValueError(f"Fp8Matmuls.matmul(which={which!r}): one of {SITES}")
        if not self.active:
            return x @ w.to(x.dtype)
        if which == "lm_head":
            out = fp8_matmul(x, w, self.lm_head_x_scale, self.lm_head_w_scale, self.lm_head_grad_scale)
        else:
            out = fp8_matmul(x, w, amax_scale(x, E4M3), amax_scale(w, E4M3), None)
        return out.to(x.dtype)

    @torch.no_grad()
    def reset(self):
        for name, value in self.initial.items():
            getattr(self, name).fill_(value)
