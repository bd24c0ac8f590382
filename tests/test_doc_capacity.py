"""Per-key document capacity sized from the data (trainer/preflight.py, data.worst_case_pieces):
corpora of short documents train without a flag, a set capacity the data can exceed is refused up
front naming the stage, and the resolved capacities reach the keys and config.json.
CPU only, ~30 s (two cpu-tiny runs of 2 steps). Run: `.venv/bin/python -m pytest tests/test_doc_capacity.py -q`.
"""

import json

import numpy as np
import pytest

from track_1_short import config as config_mod
from track_1_short.data import BOS_ID, capacity_rows, max_val_pieces, worst_case_pieces, write_shard
from track_1_short.train import train


def _short_docs(path, num_docs: int, mean_len: int, seed: int) -> None:
    """Documents of ~mean_len tokens (BOS first), ids below the GPT-2 vocab."""
    rng = np.random.default_rng(seed)
    docs = [np.concatenate([[BOS_ID], rng.integers(0, 50000, max(2, int(n)) - 1)])
            for n in rng.normal(mean_len, mean_len / 4, num_docs)]
    write_shard(path, np.concatenate(docs).astype(np.uint16))


@pytest.fixture(scope="module")
def short_corpus(tmp_path_factory):
    """~130-token documents: a 512-token cpu-tiny micro-batch holds up to ~7 of them."""
    d = tmp_path_factory.mktemp("short")
    _short_docs(d / "s_train_000000.bin", 600, 130, 0)
    _short_docs(d / "s_val_000000.bin", 60, 130, 1)
    return d


def _cpu_tiny(data_dir, runs_dir, *extra: str):
    return config_mod.parse(["--preset", "cpu-tiny", "--data-dir", str(data_dir), "--max-steps", "2",
                             "--val-tokens", "4097", "--runs-dir", str(runs_dir), "--run-id", "r",
                             *extra])


def test_cpu_tiny_trains_on_short_documents_without_a_flag(short_corpus, tmp_path, capsys):
    assert train(_cpu_tiny(short_corpus, tmp_path)) == 0
    out = capsys.readouterr().out
    assert "document capacity per batch" in out
    cfg = json.loads((tmp_path / "r" / "config.json").read_text())
    rows = [s["cu_seqlens_rows"] for s in cfg["schedule"]["stages"]]
    tokens = np.fromfile(short_corpus / "s_train_000000.bin", dtype=np.uint16, offset=1024)
    lens = np.diff(np.append(np.flatnonzero(tokens == BOS_ID), tokens.size))
    worst = [worst_case_pieces(lens, s["tokens_per_rank"], s["max_seq_len"])
             for s in cfg["schedule"]["stages"]]
    assert rows == [capacity_rows(w) for w in worst] and min(worst) > 7  # more than the old 8 rows
    assert cfg["data"]["val_cu_seqlens_rows"] >= 2
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["steps"] == 2


def test_a_set_capacity_the_data_can_exceed_is_refused_up_front(short_corpus, tmp_path, capsys):
    assert train(_cpu_tiny(short_corpus, tmp_path, "--doc-capacity", "3")) == 2
    err = capsys.readouterr().err
    assert "stage A: up to" in err and "more than its capacity 3" in err and "--doc-capacity" in err
    assert not (tmp_path / "r").exists()


def test_worst_case_and_validation_counts():
    # 3 documents of 10 tokens and 1 of 100: a 25-token slice (26 tokens) can take 3 pieces
    assert worst_case_pieces(np.array([10, 10, 10, 100]), 25, 2048) == 3
    # capped at max_seq_len: documents of 100 cut to 5 fill 26 tokens in 6 pieces
    assert worst_case_pieces(np.array([100] * 10), 25, 5) == 6
    assert capacity_rows(3) == 8 and capacity_rows(7) == 8 and capacity_rows(8) == 16
    val = np.full(40, 7, dtype=np.uint16)
    val[[0, 3, 12, 14, 15, 30]] = BOS_ID  # slices of 10: [0,10) 2 BOS (one at 0), [10,20) 3, [20,30) 0
    assert max_val_pieces(val, 10) == 4  # slice 1: its first token is no BOS, so 1 + 3 pieces
