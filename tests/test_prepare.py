"""prepare: the embedded corpus (real registry text, deterministic, held-out val) and FineWeb
downloads (huggingface_hub mocked at its boundary); idempotence and atomicity.
CPU only, ~15 s (tokenizes the 4M-token corpus once); run: pytest tests/test_prepare.py"""

import json
from pathlib import Path

import numpy as np
import pytest

from track_1_short import prepare, prepare_common
from track_1_short.data import BOS_ID, list_shards, read_shard, write_shard


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("embedded")
    stats = prepare.prepare_embedded(out, prepare.EmbeddedCorpusConfig())
    return out, stats


def _docs(tokens: np.ndarray) -> list[bytes]:
    starts = np.flatnonzero(tokens == BOS_ID)
    return [tokens[a:b].tobytes() for a, b in zip(starts, list(starts[1:]) + [tokens.size])]


def test_embedded_sizes_and_bos(built):
    out, stats = built
    train = read_shard(list_shards(out, "train")[0]).numpy()
    val = read_shard(list_shards(out, "val")[0]).numpy()
    assert train.size + val.size >= 4_000_000
    assert val.size >= 200_000
    assert train[0] == BOS_ID and val[0] == BOS_ID
    assert stats["train_tokens"] == train.size and stats["val_tokens"] == val.size
    # validation is held out by document: no validation document appears in train
    assert not set(_docs(val)) & set(_docs(train))
    lens = np.diff(np.append(np.flatnonzero(train == BOS_ID), train.size))
    assert lens.min() >= 400, "documents long enough for the speedrun keys' cu_seqlens capacity"


def test_embedded_is_deterministic_and_idempotent(built, tmp_path, capsys):
    out, _ = built
    first = {p.name: p.read_bytes() for p in out.glob("*.bin")}
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.glob("*.bin")}
    prepare.prepare_embedded(out, prepare.EmbeddedCorpusConfig())  # second run: nothing to do
    assert "nothing to do" in capsys.readouterr().out
    assert mtimes == {p.name: p.stat().st_mtime_ns for p in out.glob("*.bin")}
    train, val, _ = prepare.build_embedded(prepare.EmbeddedCorpusConfig())
    assert train.astype(np.uint16).tobytes() == first["embedded_train_000000.bin"][1024:]
    assert val.astype(np.uint16).tobytes() == first["embedded_val_000000.bin"][1024:]


def test_interrupted_prepare_is_not_complete(tmp_path, monkeypatch):
    calls = []

    def failing_write(path, tokens):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        write_shard(path, tokens)

    monkeypatch.setattr(prepare, "write_shard", failing_write)
    monkeypatch.setattr(prepare, "build_embedded",
                        lambda cfg: (np.array([BOS_ID, 1, 2]), np.array([BOS_ID, 3]), {}))
    with pytest.raises(KeyboardInterrupt):
        prepare.prepare_embedded(tmp_path, prepare.EmbeddedCorpusConfig())
    assert not (tmp_path / prepare_common.MANIFEST).exists()
    assert not list(tmp_path.glob("*.tmp*"))
    monkeypatch.setattr(prepare, "write_shard", write_shard)
    prepare.prepare_embedded(tmp_path, prepare.EmbeddedCorpusConfig())  # rebuilds, completes
    assert (tmp_path / prepare_common.MANIFEST).exists()


def test_manifest_with_corrupt_shard_rebuilds(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare, "build_embedded",
                        lambda cfg: (np.array([BOS_ID, 1, 2]), np.array([BOS_ID, 3]), {}))
    prepare.prepare_embedded(tmp_path, prepare.EmbeddedCorpusConfig())
    shard = tmp_path / "embedded_train_000000.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    settings = json.loads((tmp_path / prepare_common.MANIFEST).read_text())["settings"]
    assert not prepare_common.manifest_ok(tmp_path, settings)


def test_fineweb_download_mocked(tmp_path, monkeypatch):
    import huggingface_hub

    requested = []

    def fake_download(repo_id, filename, repo_type, local_dir):
        requested.append((repo_id, filename, repo_type))
        write_shard(Path(local_dir) / filename, np.array([BOS_ID, 1, 2, 3]))
        return str(Path(local_dir) / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    prepare.prepare_fineweb(tmp_path, train_shards=2)
    assert requested == [("kjj0/fineweb10B-gpt2", "fineweb_val_000000.bin", "dataset"),
                         ("kjj0/fineweb10B-gpt2", "fineweb_train_000001.bin", "dataset"),
                         ("kjj0/fineweb10B-gpt2", "fineweb_train_000002.bin", "dataset")]
    requested.clear()
    prepare.prepare_fineweb(tmp_path, train_shards=2)  # complete: no download
    assert requested == []
    assert [p.name for p in list_shards(tmp_path, "train")] == ["fineweb_train_000001.bin",
                                                               "fineweb_train_000002.bin"]


def test_fineweb_bad_download_names_file(tmp_path, monkeypatch):
    import huggingface_hub

    def bad_download(repo_id, filename, repo_type, local_dir):
        (Path(local_dir) / filename).write_bytes(b"<html>rate limited</html>")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", bad_download)
    assert prepare.main(["--source", "fineweb", "--train-shards", "1", "--out-dir", str(tmp_path)]) == 2
    assert not (tmp_path / prepare_common.MANIFEST).exists()


def test_bad_train_shards_flag(tmp_path, capsys):
    assert prepare.main(["--source", "fineweb", "--train-shards", "0", "--out-dir", str(tmp_path)]) == 2
    assert "--train-shards" in capsys.readouterr().err
