"""The hold's row accumulation kernels on the H200 (track_1_short/kernels/row_accumulate.py: the
atomic-free sorted one and the vector-atomic one) against acc.index_add_ at stage A and C shapes,
captured in a CUDA graph, with no host sync.

Scope: the speedrun's accumulator (754,560 rows x 768, float32) and one micro-step's sink
gradient [2T, 768]: real n-gram row ids of a token batch whose documents start every ~500
tokens (the reserved rows repeat), and ids skewed so that hot rows repeat thousands of times; the
kernel's sum against index_add_'s from the same accumulator within float32 rounding, rows no id
names bit-equal; a CUDA graph of the kernel (sort included) replayed twice equals two eager calls
(bit for bit for the deterministic sorted kernel, within rounding for the atomic one), and no call
syncs the host (torch.cuda.set_sync_debug_mode("error")). The time of both (CUDA
events, median of 20 back-to-back calls) is printed: a measurement, not asserted (bench/ngram_hold.py and
bench/step.py --set train.ngram_accumulate=... are the benchmarks).
Hardware: one CUDA GPU with ~12 GB free. Run: `PYTHONPATH=. python -m pytest -m gpu -s
tests/test_row_accumulate_gpu.py`.
"""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

pytest.importorskip("triton")

from bench.common import time_steps  # noqa: E402
from track_1_short.kernels.row_accumulate import row_accumulate_, row_accumulate_vector_  # noqa: E402
from track_1_short.model.ngram_config import NgramConfig  # noqa: E402
from track_1_short.model.ngram_lookup import NgramLookup  # noqa: E402
from track_1_short.model.tokens import BOS_ID  # noqa: E402


def _ids(kind: str, tokens: int, gen: torch.Generator) -> torch.Tensor:
    cfg = NgramConfig(cache_rows=2 * tokens)
    if kind == "skewed":
        u = torch.rand(2 * tokens, generator=gen, device="cuda")
        return (u.pow(3) * cfg.num_rows).long().clamp_(max=cfg.num_rows - 1)
    inputs = torch.randint(0, 50257, (tokens,), generator=gen, device="cuda", dtype=torch.int32)
    inputs[::500] = BOS_ID
    return NgramLookup(cfg).cuda().row_ids(inputs)  # [2T]


def _median_ms(fn, n: int = 20) -> float:
    """Median of n back-to-back calls, CUDA events at their boundaries (bench/common.time_steps)."""
    return time_steps(lambda i: fn(), n, torch.device("cuda"))["median_ms"]


@pytest.mark.parametrize("kernel", [row_accumulate_, row_accumulate_vector_], ids=["sorted", "vector"])
@pytest.mark.parametrize("tokens", [16_384, 49_152])  # stage A, stage C
@pytest.mark.parametrize("kind", ["tokens", "skewed"])
def test_against_index_add_captured_and_without_a_sync(tokens, kind, kernel):
    gen = torch.Generator(device="cuda").manual_seed(0)
    cfg = NgramConfig()
    ids = _ids(kind, tokens, gen)
    grad = torch.randn(ids.numel(), cfg.dim, generator=gen, device="cuda")
    start = torch.randn(cfg.num_rows, cfg.dim, generator=gen, device="cuda")
    ref, out = start.clone(), start.clone()
    ref.index_add_(0, ids, grad)
    torch.cuda.set_sync_debug_mode("error")
    try:
        kernel(out, ids, grad)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-4), (out - ref).abs().max()
    hit = torch.zeros(cfg.num_rows, dtype=torch.bool, device="cuda")
    hit[ids] = True
    assert torch.equal(out[~hit], start[~hit])

    graph_acc = start.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kernel(graph_acc, ids, grad)  # warm-up (compiles), then reset
    torch.cuda.current_stream().wait_stream(stream)
    graph_acc.copy_(start)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernel(graph_acc, ids, grad)
    graph.replay()
    graph.replay()
    eager = start.clone()
    kernel(eager, ids, grad)
    kernel(eager, ids, grad)
    if kernel is row_accumulate_:
        assert torch.equal(graph_acc, eager)  # deterministic: the same sums in the same order
    else:
        assert torch.allclose(graph_acc, eager, rtol=1e-5, atol=1e-4)  # atomics: any order

    acc = torch.zeros_like(start)
    atomic = _median_ms(lambda: acc.index_add_(0, ids, grad))
    kernel_ms = _median_ms(lambda: kernel(acc, ids, grad))
    print(f"\nT={tokens} {kind}: {ids.unique().numel()} distinct of {ids.numel()} ids, most "
          f"repeated {int(ids.bincount().max())}; index_add_ {atomic:.3f} ms, {kernel.__name__} "
          f"{kernel_ms:.3f} ms ({kernel_ms / atomic:.3f}x)")
