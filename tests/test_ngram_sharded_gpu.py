"""Sharded NgramStore + RowPrefetch on 2 GPUs with NCCL: the same equivalence as
tests/test_ngram_sharded.py (per-slice losses, sink gradients and updated table slices of 2 ranks
with 4 micro-steps each equal one CPU float64 process with 8), with the CUDA side stream of
RowPrefetch in use (phase A on the side stream, phase B on the compute stream), across 3 events.
Hardware: 2 CUDA GPUs (skipped with fewer); spawns 2 processes (~30 s).
Run: `.venv/bin/python -m pytest -m gpu tests/test_ngram_sharded_gpu.py -q`.
"""

import os

import pytest
import torch
import torch.multiprocessing as mp

from tests.mp_utils import free_port, set_rank_env
from tests.test_ngram_sharded import CYCLE, DIM, SCHEDULE, SLICES, STEPS, T, _cfg, _Loader
from track_1_short.distributed import destroy_distributed, init_distributed
from track_1_short.model.ngram_lookup import NgramLookup
from track_1_short.perf.ngram_store import NgramStore
from track_1_short.perf.row_prefetch import LookaheadLoader, RowPrefetch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]


class _DeviceLoader(_Loader):
    def __init__(self, rank, micro_steps, device):
        super().__init__(rank, micro_steps)
        self.device = device

    def next_batch(self):
        batch = super().next_batch()
        batch.inputs = batch.inputs.pin_memory().to(self.device, non_blocking=True)
        return batch


def train_ngram(rank: int, world_size: int, device: torch.device, group=None) -> dict:
    """The n-gram part of test_ngram_sharded.train on `device` (float64)."""
    micro_steps = SLICES // world_size
    g = torch.Generator().manual_seed(7)
    table = NgramStore(NgramLookup(_cfg()).to(device), cycle=CYCLE, micro_steps=micro_steps)
    lookup = table.lookup
    table.table.copy_(torch.randn(table.table.shape, generator=g, dtype=torch.float64))
    table.shard(rank, world_size, group)
    loader = LookaheadLoader(_DeviceLoader(rank, micro_steps, device) if device.type == "cuda"
                             else _Loader(rank, micro_steps))
    prefetch = RowPrefetch(table)
    out = {"loss": {}, "grad": {}}
    for step in range(STEPS):
        for micro in range(micro_steps):
            batch = loader.next_batch()
            ids, slots = prefetch.slots_for(batch.inputs)
            sink = lookup.grad_sink(T)
            rows = lookup.gather(slots, sink)  # [T, R]
            w = torch.linspace(-1, 1, T * DIM, dtype=torch.float64, device=device).view(T, DIM)
            loss = (torch.tanh(rows) * w * (batch.index + 1)).sum() + 0.1 * (rows ** 2).sum()
            prefetch.issue(loader)  # phase A on the side stream, under the "backward"
            (grad,) = torch.autograd.grad(loss / micro_steps, sink)
            out["loss"][(step, batch.index)] = loss.item()
            out["grad"][(step, batch.index)] = (grad * micro_steps).cpu()
            table.hold(grad.clone(), ids)
        if SCHEDULE.plan(step).ngram_event:
            table.update_event(step, lr_scale=1.0 - 0.1 * step)
    out["table"] = table.table.cpu()
    return out


def _worker(rank: int, port: int, out_dir: str):
    set_rank_env(rank, 2, port)
    ctx = init_distributed(timeout_s=120, device_type="cuda")
    torch.save(train_ngram(rank, 2, ctx.device), os.path.join(out_dir, f"rank{rank}.pt"))
    destroy_distributed()


def test_nccl_sharded_matches_single_rank(tmp_path):
    ref = train_ngram(0, 1, torch.device("cpu"))
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=2)
    per = ref["table"].shape[0] // 2
    for r in range(2):
        res = torch.load(tmp_path / f"rank{r}.pt")
        for key, loss in res["loss"].items():
            assert abs(loss - ref["loss"][key]) < 1e-9 * max(1.0, abs(loss)), f"rank {r}: loss {key}"
            assert torch.allclose(res["grad"][key], ref["grad"][key], atol=1e-12), f"rank {r}: grad {key}"
        slice_ref = ref["table"][r * per:(r + 1) * per]
        assert torch.allclose(res["table"], slice_ref, atol=1e-12, rtol=0), f"rank {r}: table slice"
    assert STEPS // CYCLE == 3
