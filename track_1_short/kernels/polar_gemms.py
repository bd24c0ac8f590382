"""Polar Express's three GEMMs from quack-kernels (CuTe DSL GEMMs for SM90 / SM100):
AnvilConfig.polar_gemms = "quack".

What it replaces: TORCH_PE_GEMMS (optim/polar_express.py, the reference): per iteration
A = X^T X (or X X^T) with bmm, then bA + cA^2 and aX + XP (or aX + PX) with baddbmm. baddbmm with
beta != 0 first copies its C operand into the output, a device memcpy of x [K, R, C] and of A
[K, N, N] per iteration; a profile on one H200 put them at 0.41 ms (x) and 0.16 ms (A) per even
optimizer step, of 3.7 ms (not yet a docs/results record: bench/polar_express.py and
docs/results/scripts/polar_call.sh measure it). Here C is read in the GEMM epilogue
(D = alpha A B + beta C into a fresh output), and the two symmetric products (A, and bA + cA^2,
a polynomial in A) use gemm_symmetric, which computes one triangle's tiles and mirrors them.

Math (x [L, R, C] in the iteration dtype, bf16 on CUDA; tall: R > C; N = C tall, R wide):
    pe_gram   tall: A = x^T x [L, C, C]   gemm_symmetric(x.mT, x)       (B = A.mT of one tensor)
              wide: A = x x^T [L, R, R]   gemm_symmetric(x, x.mT)
    pe_poly   P = b A + c A A [L, N, N]   gemm_symmetric(A, A.mT, C=A, alpha=c, beta=b)
              (A is symmetric, so A.mT is A: B = A.mT keeps both operands K-major)
    pe_apply  tall: a x + x P [L, R, C]   gemm_add(x, P, C=x, alpha=1, beta=a)
              wide: a x + P x [L, R, C]   gemm_add(P, x, C=x, alpha=1, beta=a)
Every output is a fresh contiguous tensor (never C: gemm_add with out=C and beta=1 would take
quack's in-place path), alpha and beta are Python floats (quack reads anything else as a device
tensor). quack's signatures (0.6.5, quack/gemm_interface.py): gemm_symmetric(A (L, M, K), B
(L, K, M), C=None, out=None, out_dtype=None, dynamic_scheduler=False, alpha=1.0, beta=1.0, ...);
gemm_add(A (L, M, K), B (L, K, N), C (L, M, N), out=None, bias=None, alpha=1.0, beta=1.0, ...).
quack reads each operand's major from stride(-1) == 1 (else the other of the last two dims), so
the transposed views above are taken as MN-major operands without a copy; the ops assert x is
contiguous, the layout that rule reads right.

The quack calls sit inside our own torch custom ops (`track_1_short::pe_gram`, `pe_poly`,
`pe_apply`, fake-registered), so anvil_math.anvil_bank_step_ under torch.compile(fullgraph=True)
traces only the op calls, never quack's Python; quack allocates nothing here but its launch
plans (the outputs are torch.empty in the op: capture-safe) and compiles per shape at its first
call, which the optimizer's first even step makes before OptimizerGraphs captures it.

What must stay stable: nothing persistent; the strategy object `QUACK_PE_GEMMS` is one module
global (a compiled bank step guards on it). trainer/build.py passes it to AnvilAndAdam where
`polar_express_unavailable_reason(device)` is None, else refuses optim.polar_gemms=quack.

`_quack()` is the one place the library is imported (through kernels/quack_lib.py, as kernels/relu2_mlp.py);
the CPU tests replace `_lib` with torch stand-ins that check the operand roles
(tests/test_polar_gemms.py). The kernels: tests/test_polar_gemms_gpu.py on the H200; the
timing: bench/polar_express.py.

Legend: L matrices in the batch (a bank shard's K), R rows, C cols, N = min(R, C).
"""

import torch
from torch import Tensor

from track_1_short.kernels.quack_lib import import_gemm_interface
from track_1_short.model.attention_fa4 import cute_dsl_unavailable_reason
from track_1_short.optim.polar_express import PolarGemms

_lib = None  # quack.gemm_interface once imported (the CPU tests set a stand-in)


def _quack():
    """quack.gemm_interface, or ImportError naming the package and the setting (imported once;
    polar_express_unavailable_reason calls it, so the trainer's build fails there)."""
    global _lib
    if _lib is None:
        _lib = import_gemm_interface("AnvilConfig.polar_gemms='quack'")
    return _lib


def polar_express_unavailable_reason(device: torch.device) -> str | None:
    """None when the quack Polar Express GEMMs can run on `device`, else why not."""
    return cute_dsl_unavailable_reason(device, _quack)


def _check_contiguous(op: str, name: str, t: Tensor) -> None:
    # quack infers the major from stride(-1) alone: any other layout would be read wrongly
    assert t.is_contiguous(), f"{op}: {name} must be contiguous, got strides {t.stride()}"


@torch.library.custom_op("track_1_short::pe_gram", mutates_args=())
def _pe_gram(x: Tensor, tall: bool) -> Tensor:
    """A = x^T x (tall) or x x^T (wide): one gemm_symmetric, B the transpose view of A."""
    _check_contiguous("pe_gram", "x", x)
    a = x.mT if tall else x  # [L, N, K]: K = R tall, C wide
    out = x.new_empty((a.shape[0], a.shape[1], a.shape[1]))  # [L, N, N]
    _quack().gemm_symmetric(a, a.mT, out=out)
    return out


@_pe_gram.register_fake
def _pe_gram_fake(x, tall):
    n = x.shape[2] if tall else x.shape[1]
    return x.new_empty((x.shape[0], n, n))


@torch.library.custom_op("track_1_short::pe_poly", mutates_args=())
def _pe_poly(gram: Tensor, b: float, c: float) -> Tensor:
    """b A + c A A: one gemm_symmetric with A in the epilogue (C = A, beta = b, alpha = c)."""
    _check_contiguous("pe_poly", "gram", gram)
    out = torch.empty_like(gram)  # [L, N, N]
    _quack().gemm_symmetric(gram, gram.mT, C=gram, out=out, alpha=c, beta=b)
    return out


@_pe_poly.register_fake
def _pe_poly_fake(gram, b, c):
    return gram.new_empty(gram.shape)


@torch.library.custom_op("track_1_short::pe_apply", mutates_args=())
def _pe_apply(x: Tensor, poly: Tensor, a: float, tall: bool) -> Tensor:
    """a x + x P (tall) or a x + P x (wide): one gemm_add with x in the epilogue (C = x, beta = a)."""
    _check_contiguous("pe_apply", "x", x)
    _check_contiguous("pe_apply", "poly", poly)
    out = torch.empty_like(x)  # [L, R, C]
    lhs, rhs = (x, poly) if tall else (poly, x)
    _quack().gemm_add(lhs, rhs, x, out=out, alpha=1.0, beta=a)
    return out


@_pe_apply.register_fake
def _pe_apply_fake(x, poly, a, tall):
    return x.new_empty(x.shape)


def _gram(x: Tensor, tall: bool) -> Tensor:
    return _pe_gram(x, tall)  # [L, N, N]


def _poly(gram: Tensor, b: float, c: float) -> Tensor:
    return _pe_poly(gram, float(b), float(c))  # [L, N, N]


def _apply(x: Tensor, poly: Tensor, a: float, tall: bool) -> Tensor:
    return _pe_apply(x, poly, float(a), tall)  # [L, R, C]


QUACK_PE_GEMMS = PolarGemms(name="quack", gram=_gram, poly=_poly, apply=_apply)
