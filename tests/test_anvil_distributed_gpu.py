"""AnvilAndAdam on 2 GPUs with NCCL: the same equivalence as tests/test_anvil_distributed.py (gloo).

Scope: 2 ranks, each on its own GPU computing gradients on its half of each global batch, end with
the parameters one process gets on the whole batch on cuda:0 (within 1e-5 relative: fp32 throughout,
Polar Express in fp32 instead of the bf16 it uses on CUDA by default, TF32 off), over 6
steps covering ANVIL banks, sharded and replicated Adam parameters, the value_embeds gradient
buffer and the embed/lm_head untie (the synthetic Net of the gloo test).
Hardware: 2 CUDA GPUs (skipped with fewer); spawns 2 processes (~30 s).
Run: `.venv/bin/python -m pytest -m gpu tests/test_anvil_distributed_gpu.py -q`.
"""

import os

import pytest
import torch
import torch.multiprocessing as mp

from tests.mp_utils import free_port, set_rank_env
from tests.test_anvil_distributed import Net, train
from track_1_short.distributed import destroy_distributed, init_distributed

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]


def _worker(rank: int, port: int, out_dir: str):
    set_rank_env(rank, 2, port)
    ctx = init_distributed(timeout_s=120, device_type="cuda")
    if (ctx.backend, ctx.device.index) != ("nccl", rank):
        raise RuntimeError(f"init_distributed gave {ctx}, expected nccl on cuda:{rank}")
    _fp32_matmuls()  # as the reference
    torch.save(train(rank, 2, str(ctx.device), ortho_dtype="float32"),
               os.path.join(out_dir, f"rank{rank}.pt"))
    destroy_distributed()


def _fp32_matmuls() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def test_nccl_matches_single_process(tmp_path):
    _fp32_matmuls()
    ref = train(0, 1, "cuda:0", ortho_dtype="float32")
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=2)
    start = dict(Net().named_parameters())
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        for name, want in ref.items():
            assert (want - start[name]).norm() > 0, f"{name} never updated"
            err = ((result[name] - want).norm() / want.norm()).item()
            assert err < 1e-5, f"rank {rank}: {name} relative error {err:.2e}"
