"""Kernel cases of track_1_short/kernels/fp8_quantise.py in the Triton interpreter (CPU).

Scope: quantise_both_layouts BITWISE equal (torch.equal on the uint8 views) to its slow reference
(model/fp8.py's quantise, row_major, col_major) in both layouts with their strides: e5m2 and
e4m3, bf16 and float32 inputs, with and without the row multiplier, R and C not multiples of the
tile (masked tails) over several tiles, a power-of-two scale (exact ties between fp8 values) and
one that is not, values beyond the fp8 range (saturation, infinities), zeros of both signs, fp8
subnormals; every rounding boundary of each format (each value, each midpoint and its float32
neighbours, NaN); non-contiguous inputs (a transposed view, an offset strided slice) and
non-contiguous row multipliers (a broadcast one with stride 0, as loss.sum()'s gradient is, and a
strided slice); the default 128 x 128 launch; torch.library.opcheck; torch.compile(fullgraph=True)
equal to eager, with new scale values reaching the compiled call. The interpreter runs the bit
rounding `_round_to_fp8_bits` (its own fp8 cast is not round-to-nearest-even); the hardware cast
is checked on the GPU (tests/test_softcap_ce_fp8_gpu.py).

Not collected by the normal suite (the name does not match test_*.py): TRITON_INTERPRET=1 must be
set before triton is first imported, and must not leak into other tests, so
tests/test_fp8_quantise.py runs this file in its own pytest process.
Hardware: CPU; ~0.1-0.3 s per kernel call at these shapes, ~10 s in all.
Run: `TRITON_INTERPRET=1 PYTHONPATH=. .venv/bin/python -m pytest -q tests/fp8_quantise_cases.py`.

Legend: R rows, C columns.
"""

import os

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("tests/fp8_quantise_cases.py needs TRITON_INTERPRET=1 set before triton is "
                       "imported; run it through tests/test_fp8_quantise.py or as its docstring says")

import pytest  # noqa: E402
import torch  # noqa: E402

from track_1_short.kernels.fp8_quantise import (QuantiseLaunch, interpreted,  # noqa: E402
                                                quantise_both_layouts, quantise_both_layouts_op,
                                                quantise_both_layouts_reference)
from track_1_short.model.fp8 import E4M3, E5M2, FP8_MAX  # noqa: E402

# 16 x 32 tiles: R = 37, C = 70 take 3 x 3 programs, the last row and column of tiles masked
SMALL = QuantiseLaunch(block_r=16, block_c=32, num_warps=4)
SCALES = (2.0 ** -4, 0.75 / 448)  # a power of two (quotients of fp8 midpoints stay exact) and not


def test_kernel_is_interpreted():
    assert interpreted(), "triton was imported before TRITON_INTERPRET=1 took effect"


def _values(r: int, c: int, dtype: torch.dtype, out: torch.dtype, scale: float, seed: int) -> torch.Tensor:
    """t [R, C] in `dtype` whose quotients by `scale` cover the fp8 format `out`: random values
    over ~50 octaves (fp8 subnormals to beyond the range), every tenth column midpoints between
    adjacent fp8 values (ties), a zero column of each sign and a column of +-inf."""
    g = torch.Generator().manual_seed(seed)
    octave = torch.randint(-24, 24, (r, c), generator=g).float()
    t = torch.randn(r, c, generator=g) * torch.exp2(octave) * scale
    codes = torch.arange(256, dtype=torch.uint8).view(out).float()
    codes = codes[codes.isfinite()].unique()  # [256 - NaNs - infs] ascending
    mids = (codes[1:] + codes[:-1]) / 2 * scale  # float32 (and bf16) exact: 3-4 significant bits
    t[:, ::10] = mids[torch.randint(0, mids.numel(), (r, t[:, ::10].shape[1]), generator=g)]
    t[:, 1], t[:, 2], t[:, 3] = 0.0, -0.0, float("inf")
    t[::2, 3] = -float("inf")
    return t.to(dtype)


def _row_mul(r: int, seed: int) -> torch.Tensor:
    """float32 [R] of both signs: powers of two on even rows (the ties stay ties), random
    magnitudes on odd rows."""
    g = torch.Generator().manual_seed(seed)
    m = torch.exp2(torch.randint(-3, 4, (r,), generator=g).float())
    m[1::2] = torch.rand(m[1::2].shape, generator=g) * 3
    return m * torch.where(torch.rand(r, generator=g) < 0.3, -1.0, 1.0)


def assert_bitwise(got: tuple[torch.Tensor, torch.Tensor], ref: tuple[torch.Tensor, torch.Tensor]):
    """Both layouts: same dtype, shape, strides and bits."""
    for name, a, b in zip(("row", "col"), got, ref):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride(), \
            f"{name}: {a.dtype} {tuple(a.shape)} {a.stride()} vs {b.dtype} {tuple(b.shape)} {b.stride()}"
        mismatch = a.view(torch.uint8) != b.view(torch.uint8)
        assert not mismatch.any(), (f"{name}: {int(mismatch.sum())} of {a.numel()} differ, first at "
                                    f"{mismatch.nonzero()[0].tolist()}")


@pytest.mark.parametrize("row_mul", [False, True], ids=["plain", "row_mul"])
@pytest.mark.parametrize("out", [E5M2, E4M3], ids=["e5m2", "e4m3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_bitwise_equal_to_the_reference(dtype, out, row_mul):
    r, c = 37, 70
    m = _row_mul(r, seed=5) if row_mul else None
    for k, s in enumerate(SCALES):
        t = _values(r, c, dtype, out, s, seed=k)
        scale = torch.tensor(s)
        got = quantise_both_layouts(t, scale, out, m, launch=SMALL)
        ref = quantise_both_layouts_reference(t, scale, out, m)
        assert_bitwise(got, ref)
        codes = ref[0].view(torch.uint8) & 0x7F
        # the case reaches saturation, zeros and fp8 subnormals (exponent bits 0, mantissa != 0)
        assert (ref[0].float().abs() == FP8_MAX[out]).any() and (codes == 0).any()
        assert ((codes > 0) & (codes < (4 if out == E5M2 else 8))).any()


@pytest.mark.parametrize("out", [E5M2, E4M3], ids=["e5m2", "e4m3"])
def test_every_rounding_boundary_of_each_format(out):
    """Scale 1, float32: each finite fp8 value, each midpoint between neighbours (ties to even)
    and the float32 values next to it (below and above), NaN of both signs, +-inf, float32
    subnormals and values far out of range."""
    codes = torch.arange(256, dtype=torch.uint8).view(out).float()
    codes = codes[codes.isfinite()].unique()
    mids = (codes[1:] + codes[:-1]) / 2
    inf = torch.tensor(float("inf"))
    special = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 1e30, -1e30,
                            1e-40, -1e-40, 0.0, -0.0])
    t = torch.cat([codes, mids, torch.nextafter(mids, inf), torch.nextafter(mids, -inf), special])
    t = torch.cat([t, t.new_zeros(-t.numel() % 7)]).reshape(-1, 7)  # [R, 7]: many row tiles
    scale = torch.tensor(1.0)
    assert_bitwise(quantise_both_layouts(t, scale, out, launch=SMALL),
                   quantise_both_layouts_reference(t, scale, out))


def test_non_contiguous_inputs_and_row_multipliers():
    """A transposed view (strides (1, R')) with a broadcast row multiplier (stride 0, as the
    gradient of loss.sum() arrives), and an offset strided slice with a strided multiplier."""
    scale = torch.tensor(0.75 / 448)
    base = _values(70, 37, torch.bfloat16, E5M2, 0.75 / 448, seed=3)
    t = base.t()  # [37, 70] strides (1, 37)
    m = torch.tensor(1.5).expand(37)
    assert t.stride() == (1, 37) and m.stride() == (0,)
    assert_bitwise(quantise_both_layouts(t, scale, E5M2, m, launch=SMALL),
                   quantise_both_layouts_reference(t, scale, E5M2, m))
    base = _values(40, 150, torch.float32, E4M3, 0.75 / 448, seed=4)
    t = base[2:, 1::2]  # [38, 75] strides (150, 2), storage offset 301
    m = _row_mul(76, seed=6)[::2]  # [38] stride 2
    assert t.stride() == (150, 2) and t.storage_offset() == 301
    assert_bitwise(quantise_both_layouts(t, scale, E4M3, m, launch=SMALL),
                   quantise_both_layouts_reference(t, scale, E4M3, m))


def test_default_launch():
    """The lm head's configuration: bf16, the row multiplier, e5m2, 128 x 128 tiles (2 x 3 of
    them here, masked tails in both directions)."""
    t = _values(130, 260, torch.bfloat16, E5M2, 0.75 / 448, seed=7)
    m, scale = _row_mul(130, seed=8), torch.tensor(0.75 / 448)
    assert_bitwise(quantise_both_layouts(t, scale, E5M2, m),
                   quantise_both_layouts_reference(t, scale, E5M2, m))


@pytest.mark.parametrize("row_mul", [False, True], ids=["plain", "row_mul"])
def test_opcheck(row_mul):
    t = _values(17, 40, torch.bfloat16, E5M2, 0.5, seed=9)
    m = _row_mul(17, seed=10) if row_mul else None
    torch.library.opcheck(quantise_both_layouts_op, (t, torch.tensor(0.5), m, E5M2, 16, 32, 4, True))


def test_compiled_fullgraph_equals_eager():
    """torch.compile(fullgraph=True) of a call on a transposed view: the op as one extern call
    with the fake kernel's layouts (inductor asserts them against the real outputs), bitwise
    equal to eager; the scale is read from its tensor at run time, not baked into the graph."""
    base = _values(70, 37, torch.bfloat16, E5M2, 0.75 / 448, seed=11)
    m = _row_mul(37, seed=12)

    def quantise_t(x, scale, m):
        return quantise_both_layouts(x.t(), scale, E5M2, m, launch=SMALL)

    compiled = torch.compile(quantise_t, fullgraph=True, dynamic=False)
    for s in (0.75 / 448, 0.25 / 448):
        scale = torch.tensor(s)
        got = compiled(base, scale, m)
        assert_bitwise(got, quantise_t(base, scale, m))
        assert_bitwise(got, quantise_both_layouts_reference(base.t(), scale, E5M2, m))
