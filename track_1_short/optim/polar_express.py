"""Polar Express: the orthogonalisation inside ANVIL (optim/anvil.py), and its coefficients.

What it replaces: Muon's Newton-Schulz iteration with one fixed quintic (3.4445, -4.775, 2.0315)
applied five times. Why it is better: Polar Express (Amsel et al., 2025) picks, per iteration, the
odd quintic p(x) = a x + b x^3 + c x^5 that is minimax-optimal on the interval the singular values
can still be in, so five iterations map a much wider range of (normalised) singular values close to
1. Same cost: 3 matmuls per iteration (A = X X^T; B = bA + cA^2; X <- aX + BX).

Math: for X = U diag(s) V^T, every iteration maps X -> U diag(p(s)) V^T, so the output's singular
values are the scalar composition p5(...p1(s)) of the normalised input's (tests/test_anvil_math.py
checks this, and the band below, in float64).

Coefficients: `POLAR_EXPRESS_COEFFS` are the values modded-nanogpt uses ("computed for
num_iters=5, safety_factor=2e-2, cushion=2"; facts section 4.1). `derive_coefficients()` re-derives
them from the paper's recipe and reproduces all five tuples to ~3e-15 relative, which pins down the
reading of those three words:
- lower bound l = 1e-3 on the normalised singular values, upper bound u = 1;
- each step: Remez (equioscillation) for the optimal odd quintic on [max(l, cushion*u), u] with
  cushion = 0.02 ("2" is in percent), rescaled so p(l) and p(u) are centred on 1;
- safety factor: (a, b, c) <- (a/1.02, b/1.02^3, c/1.02^5), i.e. p(x) <- p(x/1.02), applied to every
  iteration except the last, *before* the interval is advanced: l <- p(l), u <- 2 - l.
Guarantee (float64, checked by the tests): normalised singular values in [1e-3, 1] come out in
[0.8589, 1.1411] (PE_BAND rounds it out to [0.85, 1.15]); below 1e-3 they still grow monotonically but may stay under 0.85.

Precision: callers normalise in fp32 (X / (||X||_F * 1.02 + 1e-6), the 1.02 keeps the spectral norm
under 1 even after a bf16 rounding) and iterate in `dtype` (bf16 on CUDA as in the record; fp32 or
float64 in tests).

GEMMs (`PolarGemms`): the iteration's three products come from a strategy object, so one loop
serves both implementations. `TORCH_PE_GEMMS` (the default and the reference) is bmm / baddbmm;
baddbmm with beta != 0 first copies its C operand into the output (on one H200 0.41 ms per step
copying x and 0.16 ms copying the Gram matrices, of a 3.7 ms optimizer step). The quack one
(kernels/polar_gemms.py, `AnvilConfig.polar_gemms = "quack"`, resolved by trainer/build.py and
passed in: this module never imports kernels/) reads C in the GEMM epilogue instead and computes
only one triangle of each symmetric product.

Provenance: Amsel, Persson, Musco, Gower, "The Polar Express" (2025); modded-nanogpt PR #253 era
`polar_express` (banked, tall/wide split). Deviations: none in the math; no Triton XXT kernels
(plain bmm, or quack's gemm_symmetric / gemm_add with `polar_gemms="quack"`:
kernels/polar_gemms.py; `AnvilConfig.compile` wraps the function in torch.compile).

Legend: B matrices in the batch, R rows, C cols, N = min(R, C) (the Gram side).
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

# (a, b, c) per iteration, first to last.
POLAR_EXPRESS_COEFFS: tuple[tuple[float, float, float], ...] = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
PE_LOWER = 1e-3  # design lower bound of the normalised singular values
PE_BAND = (0.85, 1.15)  # output band for inputs in [PE_LOWER, 1] (float64: 0.8589..1.1411)
FROBENIUS_SLACK = 1.02
NORM_EPS = 1e-6


def _optimal_odd_quintic(lo: float, hi: float) -> tuple[float, float, float]:
    """Minimax odd quintic approximating 1 on [lo, hi] (Remez: equal error at lo, q, r, hi)."""
    if lo / hi >= 1 - 5e-6:
        # interval collapsed: the Taylor-optimal quintic at hi
        return 15 / 8 / hi, -10 / 8 / hi ** 3, 3 / 8 / hi ** 5
    q, r = (3 * lo + hi) / 4, (lo + 3 * hi) / 4
    err, prev = math.inf, None
    while prev is None or abs(prev - err) > 1e-15:
        prev = err
        nodes = torch.tensor([lo, q, r, hi], dtype=torch.float64)
        signs = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
        lhs = torch.stack([nodes, nodes ** 3, nodes ** 5, signs], dim=1)
        a, b, c, err = torch.linalg.solve(lhs, torch.ones(4, dtype=torch.float64)).tolist()
        # interior extrema of p: roots of p'(x) = a + 3b x^2 + 5c x^4
        disc = math.sqrt(9 * b * b - 20 * a * c)
        q, r = math.sqrt((-3 * b - disc) / (10 * c)), math.sqrt((-3 * b + disc) / (10 * c))
    return a, b, c


def derive_coefficients(num_iters: int = 5, lower: float = PE_LOWER, safety: float = 2e-2,
                        cushion: float = 0.02) -> list[tuple[float, float, float]]:
    """Re-derive the Polar Express schedule (see the module docstring for the recipe)."""
    lo, hi = lower, 1.0
    out = []
    for i in range(num_iters):
        a, b, c = _optimal_odd_quintic(max(lo, cushion * hi), hi)
        p_lo, p_hi = (a * x + b * x ** 3 + c * x ** 5 for x in (lo, hi))
        scale = 2 / (p_lo + p_hi)
        a, b, c = a * scale, b * scale, c * scale
        if i < num_iters - 1:
            f = 1 + safety
            a, b, c = a / f, b / f ** 3, c / f ** 5
        out.append((a, b, c))
        lo = a * lo + b * lo ** 3 + c * lo ** 5
        hi = 2 - lo
    return out


@dataclass(slots=True, frozen=True)
class PolarGemms:
    """The three GEMMs of one Polar Express iteration (tall: R > C). Each returns a new tensor
    in x's dtype and never writes its inputs (compiled callers keep x and A alive across them)."""

    name: str  # AnvilConfig.polar_gemms value this strategy implements ("torch", "quack")
    gram: Callable[[Tensor, bool], Tensor]  # (x [B, R, C], tall) -> A [B, N, N]: X^T X or X X^T
    poly: Callable[[Tensor, float, float], Tensor]  # (A, b, c) -> bA + cA^2 [B, N, N]
    apply: Callable[[Tensor, Tensor, float, bool], Tensor]  # (x, P, a, tall) -> aX + XP or aX + PX


def _torch_gram(x: Tensor, tall: bool) -> Tensor:
    return x.mT @ x if tall else x @ x.mT  # [B, C, C] tall, [B, R, R] wide


def _torch_poly(gram: Tensor, b: float, c: float) -> Tensor:
    return torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # [B, N, N]


def _torch_apply(x: Tensor, poly: Tensor, a: float, tall: bool) -> Tensor:
    return torch.baddbmm(x, x, poly, beta=a) if tall else torch.baddbmm(x, poly, x, beta=a)  # [B, R, C]


TORCH_PE_GEMMS = PolarGemms(name="torch", gram=_torch_gram, poly=_torch_poly, apply=_torch_apply)


def polar_express(g: Tensor, dtype: torch.dtype, coeffs=POLAR_EXPRESS_COEFFS,
                  gemms: PolarGemms | None = None) -> Tensor:
    """Approximate polar factor U V^T of each matrix of g [B, R, C] (fp32 in, `dtype` out).

    Wide or square (R <= C): A = X X^T [B, R, R], X <- aX + (bA + cA^2) X.
    Tall (R > C):            A = X^T X [B, C, C], X <- aX + X (bA + cA^2).
    Both keep the Gram matrix at min(R, C)^2, the cheap side. gemms: whose GEMMs compute the
    three products (None: TORCH_PE_GEMMS, the reference).
    """
    assert g.dim() == 3, f"polar_express takes a batch of matrices [B, R, C], got {tuple(g.shape)}"
    gemms = TORCH_PE_GEMMS if gemms is None else gemms
    norm = g.flatten(1).norm(dim=1).view(-1, 1, 1)  # [B, 1, 1]
    x = (g / (norm * FROBENIUS_SLACK + NORM_EPS)).to(dtype)  # [B, R, C]
    tall = g.size(1) > g.size(2)
    for a, b, c in coeffs:
        gram = gemms.gram(x, tall)  # [B, N, N]
        poly = gemms.poly(gram, b, c)  # bA + cA^2 [B, N, N]
        x = gemms.apply(x, poly, a, tall)  # [B, R, C]
    return x
