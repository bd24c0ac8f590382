"""Shared fixtures: small synthetic shard dirs (fast, any content), the real embedded corpus, and
float32 CUDA matmuls without TF32 (the GPU optimizer tests)."""

from pathlib import Path

import numpy as np
import pytest
import torch

from track_1_short.data import BOS_ID, write_shard

REPO = Path(__file__).resolve().parents[1]


def make_docs(rng: np.random.Generator, num_docs: int, min_len: int, max_len: int) -> list[np.ndarray]:
    """Random documents, each starting at BOS, with ids in [0, 50000)."""
    return [np.concatenate([[BOS_ID], rng.integers(0, 50000, rng.integers(min_len, max_len) - 1)])
            .astype(np.uint16) for _ in range(num_docs)]


@pytest.fixture(scope="session")
def shard_dir(tmp_path_factory) -> Path:
    """Two train shards and one val shard of random documents (lengths 40..400); read-only."""
    tmp_path = tmp_path_factory.mktemp("shards")
    rng = np.random.default_rng(0)
    for name, n in (("t_train_000000.bin", 60), ("t_train_000001.bin", 40), ("t_val_000000.bin", 30)):
        write_shard(tmp_path / name, np.concatenate(make_docs(rng, n, 40, 400)))
    return tmp_path


@pytest.fixture(scope="session")
def embedded_dir() -> Path:
    """The prepared embedded corpus (test.sh prepares it); skipped if absent."""
    path = REPO / "data" / "embedded"
    if not (path / "manifest.json").is_file():
        pytest.skip("data/embedded not prepared (run ./test.sh or python -m track_1_short.prepare)")
    return path


@pytest.fixture
def fp32_matmuls():
    """CUDA matmuls in true float32 (TF32 off) for the test, restored after."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved
