"""The n-gram update event on the H200: the kernel (track_1_short/kernels/ngram_adam.py) against
the store's reference at the speedrun's table shape, with no host sync.

Scope: NgramStore with the speedrun's NgramConfig (754,560 rows x 768, float32) and stage C's
held gradients (cycle 2 x 8 micro-steps of [98,304, 768]; row ids skewed so that hot rows repeat
thousands of times and a part of the table stays untouched), two events with different lr
multipliers, lazy and dense Adam (NgramConfig.update); the kernel's table and moments against
`_event_reference` from the same state (the
reference store gets the kernel store's accumulator: index_add_'s float32 atomics sum in no fixed
order, so two accumulations differ by rounding), untouched rows bit-equal; `hold` and the kernel event under torch.cuda.set_sync_debug_mode("error"); the event
time of both paths is printed (CUDA events; a measurement, not asserted: bench/step.py is the
benchmark).
Hardware: one CUDA GPU with ~25 GB free. Run: `PYTHONPATH=. python -m pytest -m gpu -s
tests/test_ngram_adam_gpu.py`.
"""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

pytest.importorskip("triton")

from track_1_short.model.ngram_config import NgramConfig  # noqa: E402
from track_1_short.model.ngram_lookup import NgramLookup  # noqa: E402
from track_1_short.perf.ngram_store import NgramStore  # noqa: E402

MICRO_STEPS, CYCLE, TOKENS = 8, 2, 49_152  # stage C on one GPU


def _store(kernel: bool, update: str = "lazy", weight_decay: float = 0.0) -> NgramStore:
    lookup = NgramLookup(NgramConfig(update=update, weight_decay=weight_decay)).cuda()
    store = NgramStore(lookup, cycle=CYCLE, micro_steps=MICRO_STEPS)
    assert store.event_kernel is not None  # a CUDA store gets the kernel
    if not kernel:
        store.event_kernel = None
    return store


def _held(gen: torch.Generator, rows: int, dim: int):
    """CYCLE x MICRO_STEPS (ids [2T], grad [2T, R]): ids skewed (sqrt of a uniform), so hot rows
    repeat thousands of times and ~1/3 of the table stays untouched."""
    for _ in range(CYCLE * MICRO_STEPS):
        u = torch.rand(2 * TOKENS, generator=gen, device="cuda")
        ids = (u.pow(3) * rows).long().clamp_(max=rows - 1)
        yield ids, torch.randn(2 * TOKENS, dim, generator=gen, device="cuda")


def _event_ms(store: NgramStore, step: int, lr_scale: float) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    store.update_event(step, lr_scale)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


@pytest.mark.parametrize("update,wd", [("lazy", 0.0), ("dense", 0.0), ("dense", 0.025)])
def test_event_kernel_equals_the_reference_without_host_sync(update, wd):
    """Lazy: rows untouched in an event stay bit-equal; dense (NgramConfig.update): rows never
    touched stay bit-equal, rows touched only in an earlier event move; wd: HEAD's bigram decay
    (NgramConfig.weight_decay)."""
    kernel, reference = _store(True, update, wd), _store(False, update, wd)
    gen = torch.Generator(device="cuda").manual_seed(0)
    init = torch.randn(kernel.table.shape, generator=gen, device="cuda")
    for s in (kernel, reference):
        s.table.copy_(init)
    times = {"kernel": [], "reference": []}
    touched_all = torch.zeros(kernel.cfg.num_rows, dtype=torch.bool, device="cuda")
    for event, lr_scale in enumerate((1.0, 0.5)):
        touched_ever = torch.zeros(kernel.cfg.num_rows, dtype=torch.bool, device="cuda")
        for ids, grad in _held(gen, kernel.cfg.num_rows, kernel.cfg.dim):
            torch.cuda.set_sync_debug_mode("error")
            kernel.hold(grad, ids)
            torch.cuda.set_sync_debug_mode(0)
            touched_ever[ids] = True
        touched_all |= touched_ever
        reference.grad_acc.copy_(kernel.grad_acc)
        reference.touched.copy_(kernel.touched)
        reference.pending = kernel.pending
        fraction = touched_ever.float().mean().item()
        assert 0.4 < fraction < 0.95, fraction
        before = kernel.table.clone()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            times["kernel"].append(_event_ms(kernel, event, lr_scale))
        finally:
            torch.cuda.set_sync_debug_mode(0)
        times["reference"].append(_event_ms(reference, event, lr_scale))
        for name in ("table", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(getattr(kernel, name), getattr(reference, name),
                                       rtol=1e-5, atol=1e-6,
                                       msg=lambda m, event=event, name=name: f"event {event}: {name}: {m}")
        still = ~touched_ever if update == "lazy" else ~touched_all
        assert torch.equal(kernel.table[still], before[still])
        if update == "dense" and event > 0:
            earlier = touched_all & ~touched_ever
            assert earlier.any() and (kernel.table[earlier] != before[earlier]).any(1).all()
        assert not kernel.grad_acc.any() and not kernel.touched.any()
        print(f"{update} event {event}: {fraction:.3f} of the rows touched; kernel "
              f"{times['kernel'][-1]:.2f} ms, reference {times['reference'][-1]:.2f} ms")
