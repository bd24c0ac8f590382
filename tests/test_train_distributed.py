"""The whole trainer on 2 gloo ranks (CPU) against 1 rank with 2 micro-steps on the same global
batch: sharded n-gram table + row prefetch, AnvilAndAdam's reductions, the collective validation,
and per-rank checkpoint shards. Spawns 2 processes, ~1 min on 2 cores;
run: pytest tests/test_train_distributed.py"""

import json

import pytest

from tests.mp_utils import free_port, set_rank_env
import torch.multiprocessing as mp

from micro import micro_config
from track_1_short.train import train


def _worker(rank: int, world: int, port: int, data_dir, runs_dir, run_id: str):
    set_rank_env(rank, world, port)
    cfg = micro_config(data_dir, runs_dir, run_id, timeout_s=120.0)
    if train(cfg) != 0:
        raise SystemExit(f"rank {rank} failed")


def test_two_ranks_match_one(shard_dir, tmp_path):
    assert train(micro_config(shard_dir, tmp_path, "one")) == 0
    mp.start_processes(_worker, args=(2, free_port(), shard_dir, tmp_path, "two"), nprocs=2,
                       join=True, start_method="spawn")
    one = json.loads((tmp_path / "one" / "summary.json").read_text())
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert two["world_size"] == 2 and two["micro_steps"] == 1 and one["micro_steps"] == 2
    vals_one = [v["val_loss"] for v in one["val_curve"]]
    vals_two = [v["val_loss"] for v in two["val_curve"]]
    assert len(vals_one) == len(vals_two)
    assert vals_two == pytest.approx(vals_one, rel=1e-4), "same global batch, same model"
    ckpt = tmp_path / "two" / "ckpt_step000012"
    assert (ckpt / ".metadata").is_file()
