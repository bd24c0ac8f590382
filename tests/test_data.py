"""Data pipeline: shard format, BOS-aligned packing, rank/micro-step sharding, epochs, the loader
thread, resume, validation slices and every bad input. CPU only; run: pytest tests/test_data.py"""

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from track_1_short.data import (BOS_ID, HEADER_BYTES, REFERENCE_WORLD_SIZE, BatchLoader, DataError,
                                SliceShape, TrainStream, list_shards, load_val_tokens,
                                make_train_loader, read_shard, val_batches, write_shard)

CPU = torch.device("cpu")


# ---------------------------------------------------------------- shard files

@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 50256), max_size=3000))
def test_shard_round_trip(tmp_path_factory, ids):
    path = tmp_path_factory.mktemp("rt") / "x_train_000000.bin"
    write_shard(path, np.array(ids, dtype=np.int64))
    got = read_shard(path)
    assert got.dtype == torch.uint16 and got.tolist() == ids
    assert path.stat().st_size == HEADER_BYTES + 2 * len(ids)
    assert not list(path.parent.glob("*.tmp*")), "temp file left behind"


def _corrupt(path: Path, offset: int, value: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset:offset + 4] = np.int32(value).tobytes()
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("offset,value,match", [(0, 1234, "bad magic"), (4, 7, "unsupported shard version"),
                                                (8, 10**6, "truncated")])
def test_bad_header_names_file(tmp_path, offset, value, match):
    path = tmp_path / "x_train_000000.bin"
    write_shard(path, np.arange(100))
    _corrupt(path, offset, value)
    with pytest.raises(DataError, match=match) as e:
        read_shard(path)
    assert str(path) in str(e.value)


def test_truncated_shard(tmp_path):
    path = tmp_path / "x_train_000000.bin"
    write_shard(path, np.arange(100))
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(DataError, match="truncated"):
        read_shard(path)
    path.write_bytes(b"\0" * 10)
    with pytest.raises(DataError, match="truncated shard"):
        read_shard(path)


def test_token_id_out_of_vocab(tmp_path):
    path = tmp_path / "x_train_000000.bin"
    write_shard(path, np.array([BOS_ID, 5, 50257, 7]))
    with pytest.raises(DataError, match="token id 50257 >= vocab size 50257"):
        read_shard(path)


def test_missing_and_empty_data_dir(tmp_path):
    with pytest.raises(DataError, match="does not exist.*prepare"):
        list_shards(tmp_path / "nope", "train")
    with pytest.raises(DataError, match="no \\*_train_\\*.bin shards.*prepare"):
        list_shards(tmp_path, "train")


# ---------------------------------------------------------------- packing

def _doc_order(stream: TrainStream, num: int) -> list[np.ndarray]:
    """The documents the stream will visit, in order, read through its own shard view."""
    probe = TrainStream(stream.shards, stream.seed, stream.shuffle)
    probe.load_state_dict(stream.state_dict())
    docs = []
    for _ in range(num):
        tokens, starts, lens = probe._shard()
        d = probe.pos.doc_pos
        docs.append(tokens[starts[d]:starts[d] + lens[d]])
        probe._advance_doc(starts.size)
    return docs


@settings(max_examples=25, deadline=None)
@given(T=st.integers(8, 700), msl=st.integers(4, 300), seed=st.integers(0, 5), skip=st.integers(0, 30))
def test_packing_invariants(shard_dir, T, msl, seed, skip):
    stream = TrainStream(list_shards(shard_dir, "train"), seed=seed)
    shape = SliceShape(T, msl, cu_seqlens_rows=T + 2)
    for _ in range(skip):
        stream.next_slice(shape)
    docs = _doc_order(stream, T + 2)
    toks, cu = np.zeros(T + 1, np.int32), np.zeros(T + 2, np.int32)
    stream.next_slice(shape, toks, cu)
    n = int(np.searchsorted(cu, T, side="left"))  # document pieces that hold inputs
    assert cu[0] == 0 and np.all(np.diff(cu) >= 0), "cu_seqlens non-decreasing from 0"
    assert np.all(cu[n:] == T), "padded with T (zero-length documents)"
    # The slice has T + 1 tokens; a document piece may start at position T, where it is only the
    # last target: then the previous piece ends at T and the extra piece is [T, T + 1).
    last_alone = min(docs[n - 1].size, msl, T + 1 - cu[n - 1]) == T - cu[n - 1]
    ends = list(cu[1:n]) + ([T, T + 1] if last_alone else [T + 1])
    if last_alone:
        cu = np.append(cu[:n], T)
        n += 1
    covered = 0
    for k, (a, b) in enumerate(zip(cu[:n], ends)):
        piece = toks[a:b]
        assert piece[0] == BOS_ID, "every document piece starts at BOS"
        expect = docs[k][:min(docs[k].size, msl, T + 1 - a)]
        assert np.array_equal(piece, expect), "each piece is its document's prefix, cut at max_seq_len"
        covered += b - a
    assert covered == T + 1, "every kept token is in exactly one document piece"


def test_capacity_error_names_key(shard_dir):
    stream = TrainStream(list_shards(shard_dir, "train"))
    with pytest.raises(DataError, match="cu_seqlens.*4 rows"):
        stream.next_slice(SliceShape(2000, 100, 4), np.zeros(2001, np.int32), np.zeros(4, np.int32))


def test_epochs_cycle_with_fresh_order(shard_dir):
    stream = TrainStream(list_shards(shard_dir, "train"), seed=3)
    first = [d.tobytes() for d in _doc_order(stream, 100)]  # 100 docs = one epoch
    shape = SliceShape(50_000, 10**6, 400)
    while stream.pos.epoch == 0:
        stream.next_slice(shape)
    stream.load_state_dict({"epoch": 1, "shard_pos": 0, "doc_pos": 0, "slices": 0})
    second = [d.tobytes() for d in _doc_order(stream, 100)]
    assert sorted(first) == sorted(second) and first != second


# ---------------------------------------------------------------- ranks, loader, resume

def _shape(step: int) -> SliceShape:
    return SliceShape(64 if step < 3 else 128, 48, 12)


def _take(loader: BatchLoader, n: int) -> list[tuple]:
    out = []
    for _ in range(n):
        b = loader.next_batch()
        out.append((b.inputs.tolist(), b.targets.tolist(), b.cum_seqlens.tolist()))
    return out


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_ranks_split_one_global_batch(shard_dir, world):
    """Any world size sees the same global batch: rank r owns slices r*A .. r*A+A-1."""
    ref = make_train_loader(shard_dir, _shape, 0, 1, CPU, seed=1, max_shape=_shape(5))
    expect = _take(ref, 6 * REFERENCE_WORLD_SIZE)
    ref.close()
    got = {}
    for rank in range(world):
        loader = make_train_loader(shard_dir, _shape, rank, world, CPU, seed=1, max_shape=_shape(5))
        got[rank] = _take(loader, 6 * REFERENCE_WORLD_SIZE // world)
        loader.close()
    A = REFERENCE_WORLD_SIZE // world
    for step in range(6):
        merged = [got[r][step * A + m] for r in range(world) for m in range(A)]
        assert merged == expect[step * REFERENCE_WORLD_SIZE:(step + 1) * REFERENCE_WORLD_SIZE]


def test_batch_dtypes_and_targets(shard_dir):
    loader = make_train_loader(shard_dir, _shape, 0, 8, CPU, seed=0, max_shape=_shape(5))
    b = loader.next_batch()
    loader.close()
    assert b.inputs.dtype == torch.int32 and b.targets.dtype == torch.int64
    assert b.cum_seqlens.dtype == torch.int32 and b.cum_seqlens.numel() == 12
    assert b.inputs[1:].tolist() == b.targets[:-1].tolist()


@settings(max_examples=6, deadline=None)
@given(stop_step=st.integers(1, 8), world=st.sampled_from([1, 2, 8]))
def test_resume_gives_identical_batches(shard_dir, stop_step, world):
    A = REFERENCE_WORLD_SIZE // world
    full = make_train_loader(shard_dir, _shape, 0, world, CPU, seed=2, max_shape=_shape(5))
    expect = _take(full, 10 * A)
    full.close()
    first = make_train_loader(shard_dir, _shape, 0, world, CPU, seed=2, max_shape=_shape(5))
    _take(first, stop_step * A)
    state = first.state_dict()
    first.close()
    assert state["step"] == stop_step
    resumed = make_train_loader(shard_dir, _shape, 0, world, CPU, seed=2, max_shape=_shape(5), state=state)
    assert _take(resumed, (10 - stop_step) * A) == expect[stop_step * A:]
    resumed.close()


def test_loader_surfaces_producer_errors(shard_dir):
    loader = make_train_loader(shard_dir, lambda s: SliceShape(2000, 100, 4), 0, 8, CPU, seed=0,
                               max_shape=SliceShape(2000, 100, 4))
    with pytest.raises(DataError, match="cu_seqlens"):
        loader.next_batch()
    loader.close()


def test_world_size_must_divide_eight(shard_dir):
    with pytest.raises(ValueError, match="world_size 3"):
        make_train_loader(shard_dir, _shape, 0, 3, CPU, seed=0, max_shape=_shape(5))


# ---------------------------------------------------------------- validation

@pytest.mark.parametrize("world", [1, 2, 3])
def test_val_slices_cover_each_token_once(shard_dir, world):
    tokens = load_val_tokens(shard_dir)
    T = 256
    seen = []
    for rank in range(world):
        for b in val_batches(tokens, T, 64, rank, world, CPU):
            cu = b.cum_seqlens.numpy()
            assert cu[0] == 0 and np.all(np.diff(cu) >= 0) and cu[-1] == T
            starts = cu[1:][cu[1:] < T]
            assert np.all(b.inputs.numpy()[starts] == BOS_ID)
            seen.append(b.targets.numpy())
    seen = np.sort(np.concatenate([s for s in seen]))
    n = (tokens.size - 1) // T
    assert seen.size == n * T
    assert np.array_equal(seen, np.sort(tokens[1:n * T + 1].astype(np.int64)))


def test_val_too_small(shard_dir):
    with pytest.raises(DataError, match="fewer than one batch"):
        next(val_batches(np.arange(10), 256, 8, 0, 1, CPU))
