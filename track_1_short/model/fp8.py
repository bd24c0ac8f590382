"""fp8 matmuls (torch._scaled_mm) for the lm head and both MLP projections, with address-stable
scale buffers.

What it replaces: the bf16 GEMMs `x @ lm_head`, `rms_norm(x) @ c_fc^T` and `relu(.)^2 @ c_proj` of
GPT.forward's training path (eval_ce never uses fp8 and never touches the scale buffers). Why
faster: Hopper's fp8 tensor cores have twice the dense bf16 peak (H100/H200 SXM ~1979 vs ~989
TFLOP/s) and the operands are half the bytes; the lm head GEMM [T, 768] x [768, 50304] is the step's
largest. Correctness: tests/test_fp8_gpu.py (each site vs the reference and bf16 at the speedrun
shapes, compiled vs eager, captured and replayed, the delayed MLP-down scales under capture, tiny
GPT fp8 vs bf16). Speed: 0.979x of bf16 at key A, forward + backward per micro-step on one H200
(30.41 vs 31.07 ms; bench/model.py, docs/results/model_fp8_layouts_h200_A.json; the two earlier
designs and their numbers are in docs/LOG.md, 2026-11-30); the training step at key C 0.947x of
bf16 with every site fp8 (docs/results/step_variants_h200_2026-12-01_fp8_C.json). On loss, the
record's fp8 (mlp_backward = "bf16") with its architecture stays within +0.02 of the record's
val loss at every point before the data repeat, over nine runs of ours and five of the record on
the same tokens (docs/results/loss_parity_embedded-large_head_mudd_fo_fp8_pooled_2026-12-02.json);
fp8 against bf16 is not separated yet (one bf16 run) and keys B and D are not timed
(TODO(model owner)), so Fp8Config.enabled defaults to False.

The op (one definition, shared by eager, torch.compile and CUDA-graph capture):
    forward   x8 = q4(x / x_s), w8 = q4(w / w_s)      (e4m3, [T, K] and [K, N])
              out = _scaled_mm(x8, w8, x_s, w_s) -> bf16 [T, N], fast accumulation
    backward  g8 = q5(g / grad_s)                     (e5m2, [T, N])
              grad_x = _scaled_mm(g8, w8^T, grad_s, w_s) -> bf16 [T, K]
              grad_w = _scaled_mm(x8^T, g8, x_s, grad_s) -> fp32 [K, N], then w's dtype
              (the MLP sites with Fp8Config.mlp_backward = "bf16", as HEAD's MLP:
              fp8_forward_matmul, the plain backward g @ w^T, x^T @ g from the saved x and w)
where q clamps to the format's finite range (+-448 e4m3, +-57344 e5m2: an out-of-range cast would
give NaN/inf) and rounds to nearest, so a value beyond 448 * scale SATURATES at +-448 * scale (this
is what happens when a delayed scale is too small); `quantise` is that one definition, and `amax` /
`amax_scale` the one definition of a current scale, used by the op, by Fp8Matmuls and by the slow
references `fp8_matmul_reference` / `fp8_matmul_backward_reference` / `delayed_scales_reference`.
_scaled_mm returns (A8 @ B8) * scale_a * scale_b, so the scales are dequantisation scales
(value = fp8 * scale). `fp8_matmul` is an autograd.Function that dynamo and AOTAutograd trace
(no graph break): the quantisations and the gradient's current amax are graph ops, which inductor
fuses into their producers, and each of the three GEMMs is one call of the torch.library custom op
`t1s::scaled_mm` (fake registered), which inductor runs as an opaque extern kernel on operands
already in cuBLASLt's layouts (layout rules below). Everything is device ops with no host sync
and no host-dependent allocation, so it is CUDA-graph capturable. x8 and w8 are saved for the
backward, each in the layout its backward GEMM reads (fp8: half the bytes of saving bf16 x and w;
the partitioner may recompute them from x and w instead). The MLP scales the op receives are
fresh tensors computed in the forward (never the delayed-scale buffers themselves), so a buffer
updated later in the same forward cannot change what the backward reads; the lm head passes its
static scale buffers themselves, which nothing writes during a step.
Compiled vs eager: when inductor fuses a quantisation into the kernel producing its operand
(e.g. relu(up)^2 of the MLP), it quantises that kernel's float32 value without first rounding it
to bf16 as eager does, so compiled and eager fp8 results differ slightly (measured on the CPU: 0.1%
in the output; equal with torch._inductor.config.emulate_precision_casts). Operands that are
materialised tensors (weights, leaves) quantise identically.

_scaled_mm layout rules (CUDA; torch's meta function checks them, so tests/test_fp8.py runs the op
bodies on fake CUDA tensors on the CPU machine): the first operand row-major (strides (K, 1)), the
second column-major (strides (1, K)), i.e. both K-major (cuBLASLt's fp8 GEMM is TN only); K and
both dims of the second operand multiples of 16. Hence T, K and N must all be multiples of 16
(grad_w contracts over T); `fp8_matmul` raises otherwise. Each GEMM's operands, made in traced code:
    forward  row_major(x8) [T, K]      @ col_major(w8) [K, N]
    grad_x   row_major(g8) [T, N]      @ row_major(w8).t() [N, K]   (column-major)
    grad_w   col_major(x8).t() [K, T]  @ col_major(g8) [T, N]        (row-major @ column-major)
so x8, w8 and g8 each exist in both layouts (two fp8 writes of each: the quantising kernel writes
one, a Triton transpose or the same kernel the other; the fp8 lm-head loss quantises its g8 into
both layouts with kernels/fp8_quantise.py and calls fp8_grads_from_quantised); the forward saves
col_major(x8) and row_major(w8) for the backward. A layout is a copy only when the tensor is not
already in it (the MLP up weight arrives as the column-major view c_fc.t() [D, F]; quantise keeps
strides).
t1s::scaled_mm carries torch.Tag.needs_exact_strides, so inductor hands the op those strides, and
its body raises (ValueError naming the operand) instead of copying when a layout is wrong.
(`.clone(memory_format=torch.contiguous_format)` rather than `.contiguous()`: the latter fails on
fake CUDA tensors in the CPU build.) The CPU _scaled_mm ignores layouts and fast accumulation.

Scales per call site (`Fp8Matmuls.matmul(x, w, which, layer)`):
- "lm_head": STATIC (facts 1.7): x_s = 100/448, w_s = 1.6/448, grad_s = 0.75/448, registered buffers.
- "mlp_up": CURRENT per-tensor amax (facts 1.7: HEAD's activation scale): x_s = amax|x|/448,
  w_s = amax|w|/448 computed in the traced forward; grad_s = amax|g|/57344 inside the backward op.
- "mlp_down": DELAYED per layer (facts 1.7, PR #342), one `DelayedScales` module per layer
  (`Fp8Matmuls.mlp_down[i]`) holding five buffers: x_scale_used, x_scale_next, w_scale_used,
  w_scale_next (float32 0-d) and bootstrap_left (int32 0-d). Each forward call of layer i:
      a_x = amax|x|, a_w = amax|w|                            (this call's operands, on device)
      bootstrap = bootstrap_left > 0
      x_s = where(bootstrap, a_x/448, where(a_x*1.80/448 == x_scale_next, x_scale_used, x_scale_next))
      w_s = the same with a_w and 1.12
      x_scale_used <- x_s, x_scale_next <- a_x*1.80/448     (in place; w likewise with 1.12)
      bootstrap_left <- max(bootstrap_left - 1, 0)
  so after bootstrap a call quantises with the previous call's amax times the margin (activations
  1.80, weights 1.12: HEAD's factors), and during bootstrap with the exact current amax. grad_s is
  the current amax of the gradient (as "mlp_up"). Bootstrap lasts Fp8Config.bootstrap_steps
  (default 16, HEAD's steps < 16) forward calls per layer after build or reset(); it exists because
  c_proj is zero at init (a delayed weight scale from zeros would saturate every weight of step 1).
  REPEATS: a call whose next-scale equals the stored one (bitwise: the same amax as the previous
  call) reuses the previous call's scale instead of advancing. That makes a re-run of the same step
  on the same buffers quantise exactly as the first run did: the capture warm iterations
  (WARM_ITERATIONS eager runs on one batch), the step graphs' self-check (replay, then eager
  forwards on the same buffers, gradients compared at 1e-2, where a different grid would differ by
  ~3%) and `--graphs check`. It relies on the forward being bitwise reproducible on the same buffers
  (same compiled kernels, no atomics before the MLP); if it were not, the self-check would fail
  loudly. Between genuinely different steps an equal amax (likely with bf16 operands: the amax of a
  bf16 tensor is one of 256 values per octave) keeps the scale of the last amax change, which is
  off the current amax by at most one step's change, as a normal delayed scale is.
  What advances the state: every training forward with fp8 active, including the warm iterations
  and self-check forwards (the bootstrap counter counts them, and micro-steps of gradient
  accumulation count one each); warmup therefore leaves the buffers advanced, and the trainer's
  post-warmup restore (checkpoint.restore_state copies every buffer back from the pre-warmup
  snapshot; reset() does the same in place) restarts bootstrap for the timed run. A CUDA graph
  captured from the forward replays the update at every replay (capture itself runs nothing).
Every amax is floored at AMAX_FLOOR so an all-zero tensor (c_proj at init) quantises to zeros, not NaN.

What must stay address-stable: every persistent scale is a registered 0-d buffer in ITS OWN storage
(cuBLASLt on torch 2.11+cu130 refused `_scaled_mm` scales at a 4-byte offset inside a larger buffer,
CUBLAS_STATUS_NOT_SUPPORTED, DESIGN.md section 4; the op raises on an offset scale), updated in
place only (the delayed ones inside the forward by copy_, no host sync, no Python branch on their
values); reset() restores them in place. Python values the compiled forward specializes on:
`active`, the `which` argument and the `layer` index. Call order: built by GPT (one DelayedScales
per layer); `resolve(device)` once by the trainer after .to(device) (warns when fp8 was asked for and
cannot run); `matmul` inside the forward.

Provenance: HEAD modded-nanogpt (facts 1.7): lm head static scales, fast-accumulation forward,
fp32 grad_w, e5m2 gradients (the `mm_op` custom op, train_gpt.py:70-162, and
FusedSoftcappedCrossEntropy, triton_kernels.py:1210-1292); MLP up current activation amax
(train_gpt.py:1498-1503); MLP down delayed per-layer scales with margins 1.80 / 1.12 and bootstrap
(PR #342, triton_kernels.py:498-566, 732-779, train_gpt.py:2365).
Deviations from HEAD:
- MLP backward is fp8 for both projections (e5m2 gradient, current amax grad_s; grad_x and grad_w
  from the saved fp8 operands); HEAD keeps the whole MLP backward in bf16 (saved bf16 post, W1, W2).
  TODO(model owner): compare validation loss with HEAD's choice once the GPU path is validated.
- MLP up weight: re-quantised every forward with its current amax; HEAD keeps a per-layer fp8 copy
  of all W1 refreshed after each optimizer step (the same scale: weights only change there).
- MLP down: the delayed scales come from an extra amax reduction per operand in the forward (HEAD:
  per-SM partial amax written by the fused up kernel); the repeat rule above (HEAD has no
  self-check re-runs); bootstrap counts forward calls, not steps (the same on 8 GPUs, where HEAD
  has no gradient accumulation); no cached transposed fp8 W2.
- Quantisation and the transposed layouts are inductor-generated kernels from traced code
  instead of HEAD's hand-written fused Triton quantise+transpose kernels (except the fused fp8
  lm-head loss's gradient: kernels/fp8_quantise.py).
- The MLP sites' backward is fp8 too by default (Fp8Config.mlp_backward = "fp8"); HEAD's stays
  bf16 ("bf16" here).

Legend: T tokens, K inner dim, N output dim, D model dim, F MLP hidden.
"""

import warnings
from collections.abc import Callable

import torch
from torch import Tensor, nn

from track_1_short.model.fp8_config import FP8_SITES, Fp8Config

E4M3 = torch.float8_e4m3fn  # forward operands
E5M2 = torch.float8_e5m2  # gradients
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}  # largest finite value of each format
E4M3_MAX = FP8_MAX[E4M3]
LM_HEAD_X_SCALE = 100.0 / E4M3_MAX  # facts 1.7
LM_HEAD_W_SCALE = 1.6 / E4M3_MAX
LM_HEAD_GRAD_SCALE = 0.75 / E4M3_MAX  # per unit of the loss's gradient scale (Fp8Matmuls' grad_scale)
MLP_DOWN_X_MARGIN = 1.80  # facts 1.7 (PR #342): delayed activation scale = prev amax * 1.80 / 448
MLP_DOWN_W_MARGIN = 1.12  # facts 1.7: delayed weight scale = previous weights' amax * 1.12 / 448
AMAX_FLOOR = 1e-12  # every amax is floored here (all-zero tensors quantise to zeros, not NaN)
MIN_CAPABILITY = (8, 9)  # fp8 tensor cores: Ada (8.9) and Hopper (9.0: H100/H200)
SITES = FP8_SITES  # Fp8Matmuls.matmul(which=...); Fp8Config.sites picks those that run in fp8
DIM_MULTIPLE = 16  # _scaled_mm: T, K and N multiples of 16 (see module docstring)


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


def fake_quantise(t: Tensor, scale: Tensor | float, dtype: torch.dtype) -> Tensor:
    """The float32 values t has after a round trip through `dtype` (the references' operands)."""
    return dequantise(quantise(t, scale, dtype), scale)


def amax(t: Tensor) -> Tensor:
    """max|t| floored at AMAX_FLOOR: float32 0-d on t's device, in its own storage, no host sync,
    no autograd (max is exact, so it does not depend on the reduction order)."""
    a = torch.linalg.vector_norm(t.detach(), ord=float("inf"), dtype=torch.float32)
    return a.clamp_min(AMAX_FLOOR)


def amax_scale(t: Tensor, dtype: torch.dtype) -> Tensor:
    """Current per-tensor scale amax(t) / FP8_MAX[dtype] (float32 0-d, own storage, no host sync);
    the floor makes zeros quantise to zeros."""
    return amax(t) / FP8_MAX[dtype]


def fp8_matmul_reference(x: Tensor, w: Tensor, x_s: Tensor | float, w_s: Tensor | float) -> Tensor:
    """Slow reference of the op's forward: dequantised e4m3 operands, float32 matmul, bf16 result.
    x [T, K], w [K, N] -> bf16 [T, N]. Any device, any float dtype."""
    return (fake_quantise(x, x_s, E4M3) @ fake_quantise(w, w_s, E4M3)).to(torch.bfloat16)


def fp8_matmul_backward_reference(g: Tensor, x: Tensor, w: Tensor, x_s: Tensor | float,
                                  w_s: Tensor | float, grad_s: Tensor | float | None
                                  ) -> tuple[Tensor, Tensor]:
    """Slow reference of the op's backward: (grad_x bf16 [T, K], grad_w float32 [K, N]) from the
    output gradient g [T, N] quantised to e5m2 (grad_s None: current amax scale of g)."""
    g_s = amax_scale(g, E5M2) if grad_s is None else grad_s
    gq = fake_quantise(g, g_s, E5M2)  # [T, N]
    xq = fake_quantise(x, x_s, E4M3)  # [T, K]
    wq = fake_quantise(w, w_s, E4M3)  # [K, N]
    return (gq @ wq.t()).to(torch.bfloat16), xq.t() @ gq


def delayed_scales_reference(amaxes: list[float], margin: float, bootstrap_steps: int) -> list[float]:
    """Slow reference of DelayedScales for one operand: the scale each call of a sequence uses,
    given the (floored) amax of that call's operand. Plain Python floats (float64), so compare with
    a float32 tolerance."""
    used, nxt, out = 1.0, 1.0, []  # initial buffer values (never used: bootstrap_steps >= 1)
    for k, a in enumerate(amaxes):
        new_next = a * margin / E4M3_MAX
        if k < bootstrap_steps:
            used = a / E4M3_MAX
        elif new_next != nxt:  # a repeat (same amax as the previous call) keeps the used scale
            used = nxt
        nxt = new_next
        out.append(used)
    return out


# ---- the op: quantisation as traced code, each GEMM one opaque custom op ----

def row_major(t: Tensor) -> Tensor:
    """[R, C] with strides (C, 1): t itself when already so, else a copy. Traced code (inductor
    writes the copy from the kernel that produced t)."""
    return t if t.is_contiguous() else t.clone(memory_format=torch.contiguous_format)


def col_major(t: Tensor) -> Tensor:
    """[R, C] with strides (1, R): t itself when already so, else a transposed copy (traced)."""
    return row_major(t.t()).t()


def _check_layout(t: Tensor, name: str, major: str):
    # cuBLASLt's fp8 GEMM takes only this layout (TN); fp8_matmul makes it in traced code, and the
    # op's needs_exact_strides tag makes inductor hand those strides over. An explicit raise: a
    # copy here would be a silent slow path (aten's strided fp8 copy was a third of the fp8 step).
    ok = t.is_contiguous() if major == "row" else t.t().is_contiguous()
    if not ok:
        raise ValueError(f"t1s::scaled_mm: operand {name} {tuple(t.shape)} has strides {t.stride()}, "
                         f"needs {major}-major; build it with fp8.{major}_major() before the op")


def _check_scale(s: Tensor, name: str):
    # Raised here, not left to cuBLASLt: an offset scale failed with CUBLAS_STATUS_NOT_SUPPORTED.
    if s.dtype != torch.float32 or s.dim() != 0 or s.storage_offset() != 0:
        why = "; cuBLASLt refuses offset scales" if s.storage_offset() != 0 else ""
        raise ValueError(f"fp8 scale {name}: needs a float32 0-d tensor in its own storage "
                         f"(got dtype {s.dtype}, shape {tuple(s.shape)}, storage offset "
                         f"{s.storage_offset()}){why}")


def scaled_mm_body(a8: Tensor, b8: Tensor, a_s: Tensor, b_s: Tensor, out_dtype: torch.dtype,
                   fast_accum: bool) -> Tensor:
    """Body of t1s::scaled_mm: (a8 [M, K] @ b8 [K, N]) * a_s * b_s -> out_dtype [M, N] (fp8
    operands, float32 0-d dequantisation scales). a8 must be row-major and b8 column-major (the
    only layout cuBLASLt's fp8 GEMM takes); ValueError naming the operand otherwise."""
    _check_scale(a_s, "a_s")
    _check_scale(b_s, "b_s")
    _check_layout(a8, "a8", "row")
    _check_layout(b8, "b8", "col")
    return torch._scaled_mm(a8, b8, a_s, b_s, out_dtype=out_dtype, use_fast_accum=fast_accum)


# needs_exact_strides: inductor passes the operands with the strides the traced code gave them
# (row_major / col_major above). It is the default for custom ops in recent torch versions; the tag
# states it here because these layouts are load-bearing.
scaled_mm = torch.library.custom_op("t1s::scaled_mm", scaled_mm_body, mutates_args=(),
                                    tags=(torch.Tag.needs_exact_strides,))


@scaled_mm.register_fake
def _scaled_mm_fake(a8, b8, a_s, b_s, out_dtype, fast_accum):
    return a8.new_empty((a8.shape[0], b8.shape[1]), dtype=out_dtype)


class _Fp8Matmul(torch.autograd.Function):
    """x [T, K] @ w [K, N] in fp8 (module docstring, "The op"). Traced by dynamo/AOTAutograd, so
    the quantisations are graph code that inductor fuses into the kernels producing x, w and the
    output gradient; the three GEMMs are t1s::scaled_mm calls."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, x_s: Tensor, w_s: Tensor, grad_s: Tensor | None):
        x8, w8 = quantise_operands(x, w, x_s, w_s)
        # each operand in the layout of each GEMM that reads it (module docstring, layout rules)
        ctx.save_for_backward(col_major(x8), row_major(w8), x_s, w_s, grad_s)
        ctx.dtypes = (x.dtype, w.dtype)
        return scaled_mm(row_major(x8), col_major(w8), x_s, w_s, torch.bfloat16, True)  # [T, N]

    @staticmethod
    def backward(ctx, g: Tensor):
        x8_col, w8_row, x_s, w_s, grad_s = ctx.saved_tensors  # [T, K] col-, [K, N] row-major
        g_s = amax_scale(g, E5M2) if grad_s is None else grad_s
        grad_x, grad_w = fp8_matmul_grads(g, g_s, x8_col, w8_row, x_s, w_s, ctx.dtypes)
        return grad_x, grad_w, None, None, None


class _Fp8ForwardMatmul(torch.autograd.Function):
    """x [T, K] @ w [K, N] with _Fp8Matmul's forward and the plain backward in x's dtype from the
    saved x and w (Fp8Config.mlp_backward = "bf16": HEAD's MLP, facts 1.7). Saves x and w
    themselves (twice the bytes of the fp8 copies)."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, x_s: Tensor, w_s: Tensor):
        x8, w8 = quantise_operands(x, w, x_s, w_s)
        ctx.save_for_backward(x, w)
        return scaled_mm(row_major(x8), col_major(w8), x_s, w_s, torch.bfloat16, True)  # [T, N]

    @staticmethod
    def backward(ctx, g: Tensor):
        x, w = ctx.saved_tensors  # [T, K], [K, N]
        g = g.to(x.dtype)
        return g @ w.to(x.dtype).t(), (x.t() @ g).to(w.dtype), None, None


def fp8_forward_matmul(x: Tensor, w: Tensor, x_s: Tensor, w_s: Tensor) -> Tensor:
    """x [T, K] @ w [K, N] -> bf16 [T, N]: the forward in fp8 (fp8_matmul's), the backward as x @ w's
    in x's dtype. T, K, N multiples of 16 (ValueError otherwise)."""
    _check_matmul_operands("fp8_forward_matmul", x, w)
    return _Fp8ForwardMatmul.apply(x, w, x_s, w_s)


def _check_matmul_operands(where: str, x: Tensor, w: Tensor) -> None:
    """ValueError naming `where` unless x [T, K] @ w [K, N] with T, K, N multiples of 16."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"{where}: x [T, K] @ w [K, N] expected, got {tuple(x.shape)} @ {tuple(w.shape)}")
    check_fp8_dims(where, x, w, "T, K, N", "pad the batch or run with --no-fp8")


def quantise_operands(x: Tensor, w: Tensor, x_s: Tensor, w_s: Tensor) -> tuple[Tensor, Tensor]:
    """The forward's e4m3 operands x8 [T, K], w8 [K, N] (strides as given; the GEMM that reads
    each one picks its layout with row_major / col_major)."""
    return quantise(x, x_s, E4M3), quantise(w, w_s, E4M3)


def fp8_matmul_grads(g: Tensor, g_s: Tensor, x8_col: Tensor, w8_row: Tensor, x_s: Tensor,
                     w_s: Tensor, dtypes: tuple[torch.dtype, torch.dtype]) -> tuple[Tensor, Tensor]:
    """The backward of x [T, K] @ w [K, N] in fp8 from the output gradient g [T, N]: g quantised
    to e5m2 by g_s (traced code), then fp8_grads_from_quantised. x8_col / w8_row: the forward's
    operands, column- / row-major. fp8_matmul's backward."""
    g8 = quantise(g, g_s, E5M2)  # [T, N]
    return fp8_grads_from_quantised(row_major(g8), col_major(g8), g_s, x8_col, w8_row, x_s, w_s, dtypes)


def fp8_grads_from_quantised(g8_row: Tensor, g8_col: Tensor, g_s: Tensor, x8_col: Tensor,
                             w8_row: Tensor, x_s: Tensor, w_s: Tensor,
                             dtypes: tuple[torch.dtype, torch.dtype]) -> tuple[Tensor, Tensor]:
    """The backward GEMMs of x [T, K] @ w [K, N] in fp8 from the e5m2 output gradient g8 [T, N]
    (dequantisation scale g_s) in both layouts, g8_row row-major and g8_col column-major:
    grad_x = g8 @ w8^T and grad_w = x8^T @ g8 (float32), cast to `dtypes` (x's, w's). x8_col /
    w8_row: the forward's operands, column- / row-major. One definition for fp8_matmul (through
    fp8_matmul_grads) and the fp8 lm-head loss (kernels/softcap_ce_fp8.py, whose g8 comes from a
    kernel writing both layouts)."""
    # HEAD's choice: exact (non-fast) accumulation for both gradient GEMMs
    grad_x = scaled_mm(g8_row, w8_row.t(), g_s, w_s, torch.bfloat16, False)  # [T, N] @ [N, K]
    grad_w = scaled_mm(x8_col.t(), g8_col, x_s, g_s, torch.float32, False)  # [K, T] @ [T, N]
    return grad_x.to(dtypes[0]), grad_w.to(dtypes[1])


def check_fp8_dims(where: str, x: Tensor, w: Tensor, names: str, fix: str) -> None:
    """ValueError unless x [T, K] and w [K, N] have T, K, N multiples of DIM_MULTIPLE
    (torch._scaled_mm); `names` spells the three dims for the message, `fix` says what to do."""
    dims = (x.shape[0], x.shape[1], w.shape[1])
    if any(d % DIM_MULTIPLE for d in dims):
        raise ValueError(f"{where}: {names} = {dims} must be multiples of {DIM_MULTIPLE} "
                         f"(torch._scaled_mm); {fix}")


def fp8_matmul(x: Tensor, w: Tensor, x_s: Tensor, w_s: Tensor,
               grad_s: Tensor | None = None) -> Tensor:
    """x [T, K] @ w [K, N] -> bf16 [T, N] in fp8 (differentiable in x and w). Scales are float32
    0-d tensors on x's device in their own storage; grad_s None = current amax of the gradient.
    T, K, N must be multiples of 16 (ValueError otherwise)."""
    _check_matmul_operands("fp8_matmul", x, w)
    return _Fp8Matmul.apply(x, w, x_s, w_s, grad_s)


def fp8_unavailable_reason(device: torch.device) -> str | None:
    """Why fp8 matmuls cannot run on `device` (None: they can)."""
    if device.type != "cuda":
        return "not a CUDA device"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < MIN_CAPABILITY:
        return (f"compute capability {major}.{minor} < {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} "
                "(no fp8 tensor cores for torch._scaled_mm)")
    return None


def _delayed_scale(t: Tensor, used: Tensor, nxt: Tensor, margin: float, bootstrap: Tensor) -> Tensor:
    """The e4m3 scale for operand t under the delayed rule (module docstring), updating the
    buffers `used` and `nxt` in place. Returns a fresh float32 0-d tensor (own storage), never a
    buffer: the op saves it for the backward. Device ops only, no host sync, no Python branch."""
    a = amax(t)  # this call's operand
    new_next = a * (margin / E4M3_MAX)  # the delayed scale for the next call
    repeat = new_next == nxt  # same amax as the previous call: a re-run of the same step
    scale = torch.where(bootstrap, a / E4M3_MAX, torch.where(repeat, used, nxt))
    used.copy_(scale)
    nxt.copy_(new_next)
    return scale


class DelayedScales(nn.Module):
    """One layer's MLP-down scale state (module docstring, "mlp_down"): five 0-d buffers, each a
    separate registration and therefore a separate storage at offset 0."""

    SCALES = ("x_scale_used", "x_scale_next", "w_scale_used", "w_scale_next")

    def __init__(self, bootstrap_steps: int):
        super().__init__()
        self.bootstrap_steps = bootstrap_steps
        for name in self.SCALES:
            # 1.0: a valid scale, never used for quantising (bootstrap covers the first call)
            self.register_buffer(name, torch.ones((), dtype=torch.float32))
        self.register_buffer("bootstrap_left", torch.tensor(bootstrap_steps, dtype=torch.int32))

    def scales(self, x: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
        """(x_s, w_s) for this call of x [T, K] @ w [K, N]; advances the state in place."""
        bootstrap = self.bootstrap_left > 0  # bool 0-d on device
        x_s = _delayed_scale(x, self.x_scale_used, self.x_scale_next, MLP_DOWN_X_MARGIN, bootstrap)
        w_s = _delayed_scale(w, self.w_scale_used, self.w_scale_next, MLP_DOWN_W_MARGIN, bootstrap)
        self.bootstrap_left.copy_((self.bootstrap_left - 1).clamp_min(0))
        return x_s, w_s

    @torch.no_grad()
    def reset(self):
        for name in self.SCALES:
            getattr(self, name).fill_(1.0)
        self.bootstrap_left.fill_(self.bootstrap_steps)


FusedMlp = Callable[[Tensor, Tensor, Tensor], Tensor]  # (x [T, D], w_up [F, D], w_down [F, D]) -> [T, D]


class PlainMatmuls(nn.Module):
    """The default matmul strategy of GPT's training forward (and always of eval): x @ w in x's
    dtype at every call site. No buffers. The trainer installs Fp8Matmuls instead (--fp8), and
    may give either one a fused MLP (`use_fused_mlp`, e.g. kernels/relu2_mlp.py's), which then
    replaces the two MLP call sites while every other site keeps this strategy's matmul."""

    def __init__(self):
        super().__init__()
        self.fused_mlp: FusedMlp | None = None
        self.mlp_label: str | None = None  # the fused MLP's name (the trainer's log line)

    def use_fused_mlp(self, fn: FusedMlp, label: str, fp8_sites: tuple[str, ...] = ()) -> None:
        """`fn` computes relu2_mlp from now on (the same math, checked against the reference
        below by its own tests); `label` names it in the run log. `fp8_sites`: the MLP call
        sites `fn` runs in fp8 itself (e.g. ("mlp_up",)); this plain strategy runs none in fp8,
        so it refuses any (ValueError)."""
        if fp8_sites:
            raise ValueError(f"a fused MLP with fp8 sites {list(fp8_sites)} ({label}) needs the fp8 "
                             f"strategy (--fp8 with those sites in model.fp8.sites)")
        self.fused_mlp, self.mlp_label = fn, label

    def matmul(self, x: Tensor, w: Tensor, which: str, layer: int | None = None) -> Tensor:
        """x [T, K] @ w [K, N] -> [T, N] in x's dtype (`which`, `layer` name the call site)."""
        return x @ w.to(x.dtype)

    def relu2_mlp(self, x: Tensor, w_up: Tensor, w_down: Tensor, layer: int) -> Tensor:
        """The MLP: relu(x @ w_up^T)^2 @ w_down, x [T, D], w_up [F, D] (out x in), w_down [F, D]
        (in x out) -> [T, D]; the fused MLP where one is set, else through `matmul` per call
        site (mlp_up, then mlp_down of `layer`). The one definition of the MLP's math:
        kernels/relu2_mlp.py's fused MLP is checked against it."""
        if self.fused_mlp is not None:
            return self.fused_mlp(x, w_up, w_down)
        up = self.matmul(x, w_up.t(), "mlp_up")  # [T, F]
        return self.matmul(torch.relu(up).square(), w_down, "mlp_down", layer=layer)


class Fp8Matmuls(PlainMatmuls):
    """The fp8 matmul strategy: the lm head's static scale buffers, the MLP down projections'
    per-layer delayed scales (`mlp_down[i]`), and the matmul that picks fp8 or bf16 per call
    site. Installed by the trainer as GPT.matmuls (trainer/build.py) for the training forward
    only; eval keeps PlainMatmuls, so it never quantises nor advances the delayed scales."""

    def __init__(self, cfg: Fp8Config, *, num_layers: int, grad_scale: float = 1.0):
        """grad_scale: the training loss's gradient scale, the upstream gradient of every token's
        loss (1 / micro-steps: perf/cuda_graphs/grad_handoff.loss_scale). The lm head's e5m2 gradient
        scale is LM_HEAD_GRAD_SCALE x grad_scale, as HEAD's grad_s = grad_scale x 0.75 / 448
        (facts 1.7), so the quantised logit gradient keeps its range whatever the micro-step
        count (with 1 / 8 and the unscaled constant it sat 8x lower in e5m2, nearer its
        subnormals)."""
        super().__init__()
        if not grad_scale > 0:
            raise ValueError(f"Fp8Matmuls(grad_scale={grad_scale}): must be > 0 (1 / micro-steps)")
        self.cfg = cfg
        self.active = False  # set by resolve(); False = bf16/fp32 path
        self.initial = {"lm_head_x_scale": LM_HEAD_X_SCALE, "lm_head_w_scale": LM_HEAD_W_SCALE,
                        "lm_head_grad_scale": LM_HEAD_GRAD_SCALE * grad_scale}
        for name, value in self.initial.items():
            # one registration = one allocation: each scale has its own aligned storage
            self.register_buffer(name, torch.tensor(value, dtype=torch.float32))
        self.mlp_down = nn.ModuleList(DelayedScales(cfg.bootstrap_steps) for _ in range(num_layers))

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

    def matmul(self, x: Tensor, w: Tensor, which: str, layer: int | None = None) -> Tensor:
        """x [T, K] @ w [K, N] -> [T, N] in x's dtype. Active and `which` in Fp8Config.sites: fp8
        with the scales of call site `which` ("lm_head": static, "mlp_up": current amax,
        "mlp_down": delayed, per `layer`, whose buffers this call advances); otherwise x @ w in
        x's dtype and no buffer is touched."""
        if which not in SITES:
            raise ValueError(f"Fp8Matmuls.matmul(which={which!r}): one of {SITES}")
        if which == "mlp_down" and not (layer is not None and 0 <= layer < len(self.mlp_down)):
            raise ValueError(f"Fp8Matmuls.matmul(which='mlp_down', layer={layer}): the layer index "
                             f"in [0, {len(self.mlp_down)}) selects the delayed scales")
        if not self.active or which not in self.cfg.sites:
            return x @ w.to(x.dtype)
        if which == "lm_head":
            out = fp8_matmul(x, w, self.lm_head_x_scale, self.lm_head_w_scale, self.lm_head_grad_scale)
        else:
            x_s, w_s = ((amax_scale(x, E4M3), amax_scale(w, E4M3)) if which == "mlp_up"
                        else self.mlp_down[layer].scales(x, w))
            out = (fp8_forward_matmul(x, w, x_s, w_s) if self.cfg.mlp_backward == "bf16"
                   else fp8_matmul(x, w, x_s, w_s, None))
        return out.to(x.dtype)

    def use_fused_mlp(self, fn: FusedMlp, label: str, fp8_sites: tuple[str, ...] = ()) -> None:
        """As PlainMatmuls', where the fused MLP runs in fp8 exactly the MLP sites this
        strategy's config asks for (`fp8_sites`, e.g. ("mlp_up",) with the fp8 up projection);
        any other pairing, or fp8 MLP sites without Fp8Config.mlp_backward "bf16" (the fused
        MLP's backward is bf16), is refused (ValueError: Fp8Config.fused_mlp_refusal)."""
        refusal = self.cfg.fused_mlp_refusal(fp8_sites)  # Fp8Config's one rule
        if refusal is not None:
            raise ValueError(f"a fused MLP ({label}) {refusal}")
        self.fused_mlp, self.mlp_label = fn, label

    @torch.no_grad()
    def reset(self):
        """Every buffer back to its initial value in place (MLP down: bootstrap again)."""
        for name, value in self.initial.items():
            getattr(self, name).fill_(value)
        for scales in self.mlp_down:
            scales.reset()
