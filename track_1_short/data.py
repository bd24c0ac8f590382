"""Shard files, BOS-aligned packing into fixed-shape batches, and the background loader.

What it replaces: modded-nanogpt's generator loader (facts 2.1-2.3), which reads shards into pinned
memory and packs whole documents per rank. What this adds: a seeded document order per epoch (the
embedded corpus is small, so runs cycle over it), an exact resumable position, a loader thread
that never gates the GPU step (bench/loader.py), and errors that name the file or setting.

Layout on disk (DESIGN section 4, "Shard file"): a header of 256 int32 (magic 20240520, version 1,
token count) then the tokens as uint16. A data dir holds `*_train_NNNNNN.bin` and `*_val_NNNNNN.bin`.

Packing (DESIGN sections 3-4): the training stream is one deterministic sequence of slices of
T + 1 tokens. A slice takes documents in the epoch's order, each truncated to max_seq_len and to
what the slice still needs (the rest of that document is dropped), so every document piece starts
at BOS (50256). inputs = slice[:-1], targets = slice[1:], cum_seqlens = [0, piece ends..., T]
padded with T (zero-length documents) to the key's fixed capacity. A step consumes
`slices_per_step` slices (default REFERENCE_WORLD_SIZE = 8, the speedrun's ranks); rank r with
A = slices_per_step / world_size micro-steps takes slices
r*A .. r*A + A - 1, so per-rank shapes and the global batch are the same on any GPU count.

What must stay stable: nothing here is baked into a CUDA graph; the step graphs copy each Batch into
their own static buffers. The pinned ring slots are reused only after the event recorded behind
their last host-to-device copy has completed.

Call order: `TrainStream` (pure numpy, deterministic) -> `BatchLoader` thread (fills pinned slots)
-> `BatchLoader.next_batch()` in the training loop (issues non_blocking H2D copies).
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
from torch import Tensor

from track_1_short.constants import REFERENCE_WORLD_SIZE
from track_1_short.model.tokens import BOS_ID, GPT2_VOCAB

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4

PREPARE_HINT = ("prepare data first: `python -m track_1_short.prepare --source embedded` "
                "(offline) or `--source fineweb --train-shards N`")


class DataError(ValueError):
    """Bad data on disk or a batch that cannot be built; the message names the file or setting."""


@dataclass(slots=True)
class Batch:
    """One micro-step's tokens for one rank.

    inputs       int32 [T]          token ids
    targets      int64 [T]          next-token ids (inputs shifted by one)
    cum_seqlens  int32 [C]          document starts: 0, then piece ends, padded with T
                                    (zero-length documents); C = the key's fixed capacity
    """

    inputs: Tensor
    targets: Tensor
    cum_seqlens: Tensor


# ---------------------------------------------------------------- shard files

def write_shard(path: str | os.PathLike, tokens: np.ndarray) -> None:
    """Write tokens (any int array, values < 65536) as a shard: temp file + rename, so an
    interrupted write never leaves a file that looks valid."""
    path = Path(path)
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**16):
        raise DataError(f"{path}: token ids must fit uint16, got range [{tokens.min()}, {tokens.max()}]")
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[:3] = (SHARD_MAGIC, SHARD_VERSION, tokens.size)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype(np.uint16, copy=False).tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_header(path: str | os.PathLike) -> int:
    """Validate a shard's header and size; return its token count."""
    path = Path(path)
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise DataError(f"{path}: truncated shard ({size} bytes < the {HEADER_BYTES}-byte header); "
                        f"delete it and {PREPARE_HINT}")
    header = np.fromfile(path, dtype=np.int32, count=HEADER_INTS)
    if header[0] != SHARD_MAGIC:
        raise DataError(f"{path}: bad magic {header[0]} (expected {SHARD_MAGIC}): not a shard file")
    if header[1] != SHARD_VERSION:
        raise DataError(f"{path}: unsupported shard version {header[1]} (expected {SHARD_VERSION})")
    count = int(header[2])
    if size != HEADER_BYTES + 2 * count:
        raise DataError(f"{path}: truncated or padded shard: header says {count} tokens "
                        f"({HEADER_BYTES + 2 * count} bytes) but the file has {size} bytes; "
                        f"delete it and {PREPARE_HINT}")
    return count


def read_shard(path: str | os.PathLike, vocab_size: int = GPT2_VOCAB,
               pin_memory: bool = False) -> Tensor:
    """A shard's tokens as a uint16 tensor [N], read with readinto (pinned if asked), validated."""
    path = Path(path)
    count = read_header(path)
    tokens = torch.empty(count, dtype=torch.uint16, pin_memory=pin_memory)
    with open(path, "rb", buffering=0) as f:
        f.seek(HEADER_BYTES)
        got = f.readinto(tokens.numpy().view(np.uint8))
    if got != 2 * count:
        raise DataError(f"{path}: read {got} bytes of tokens, expected {2 * count}")
    if count and int(tokens.numpy().max()) >= vocab_size:
        bad = int(tokens.numpy().max())
        raise DataError(f"{path}: token id {bad} >= vocab size {vocab_size}; the shard was not "
                        f"written with the GPT-2 tokenizer. Re-prepare it ({PREPARE_HINT})")
    return tokens


def list_shards(data_dir: str | os.PathLike, split: str) -> list[Path]:
    """Sorted `*_{split}_*.bin` shards of a data dir; a clear error if there are none."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(f"data dir {data_dir} does not exist; {PREPARE_HINT} (or pass --data-dir)")
    shards = sorted(data_dir.glob(f"*_{split}_*.bin"))
    if not shards:
        raise DataError(f"data dir {data_dir} has no *_{split}_*.bin shards; {PREPARE_HINT}")
    return shards


@dataclass(slots=True, frozen=True)
class ShardStats:
    """What check_shards found: token counts per split, the training documents' lengths (what
    the packing sees: from each BOS to the next) and the shards checked."""

    train_tokens: int
    val_tokens: int
    train_doc_lens: np.ndarray  # int64 [num_docs]
    shards: tuple[Path, ...]


def check_shard(path: Path, vocab_size: int = GPT2_VOCAB) -> np.ndarray:
    """Header, size, token range and BOS of one shard without reading it into memory (a memmap and
    two vectorised passes); returns its documents' lengths (from each BOS to the next or the end;
    tokens before the first BOS belong to no document). DataError names the file and the fix."""
    count = read_header(path)
    if count == 0:
        raise DataError(f"{path}: an empty shard (0 tokens); delete it and {PREPARE_HINT}")
    tokens = np.memmap(path, dtype=np.uint16, mode="r", offset=HEADER_BYTES, shape=(count,))
    top = int(tokens.max())
    if top >= vocab_size:
        raise DataError(f"{path}: token id {top} >= vocab size {vocab_size}; the shard was not "
                        f"written with the GPT-2 tokenizer or is damaged. Re-prepare it ({PREPARE_HINT})")
    starts = np.flatnonzero(tokens == BOS_ID)
    if starts.size == 0:
        raise DataError(f"{path}: no BOS ({BOS_ID}) token: documents must each start with BOS; "
                        f"re-prepare it ({PREPARE_HINT})")
    return np.diff(np.append(starts, count))


def check_shards(data_dir: str | os.PathLike, vocab_size: int = GPT2_VOCAB) -> ShardStats:
    """check_shard on every train and val shard of a data dir, before a run starts."""
    lens = {split: [(p, check_shard(p, vocab_size)) for p in list_shards(data_dir, split)]
            for split in ("train", "val")}
    return ShardStats(train_tokens=sum(read_header(p) for p, _ in lens["train"]),
                      val_tokens=sum(read_header(p) for p, _ in lens["val"]),
                      train_doc_lens=np.concatenate([d for _, d in lens["train"]]),
                      shards=tuple(p for split in lens.values() for p, _ in split))


# ---------------------------------------------------------------- document capacity

CAPACITY_ROUND = 8  # cu_seqlens lengths are rounded up to a multiple of this


def worst_case_pieces(doc_lens: np.ndarray, tokens: int, max_seq_len: int) -> int:
    """The most document pieces one training slice (tokens + 1 tokens) can take over every
    document order: the count of the shortest documents, each cut to max_seq_len, that together
    fill it. The stream cycles over the corpus, so a slice can span an epoch boundary and hold a
    document twice (more often when the corpus is shorter than a slice): the documents are
    counted once per epoch the slice can touch."""
    lens = np.minimum(np.asarray(doc_lens, dtype=np.int64), max_seq_len)
    if lens.size == 0 or lens.sum() == 0:
        raise DataError("no training documents: every shard is empty of BOS-started documents")
    repeats = -(-(tokens + 1) // int(lens.sum())) + 1
    filled = np.cumsum(np.sort(np.tile(lens, repeats)))
    return int(np.searchsorted(filled, tokens + 1)) + 1


def max_val_pieces(tokens: np.ndarray, tokens_per_batch: int) -> int:
    """The most document pieces of any validation slice (val_batches' contiguous slices: one
    piece, plus one more per BOS after the slice's first token)."""
    T = tokens_per_batch
    num = num_val_slices(tokens.size, T)
    bos = np.flatnonzero(tokens[:num * T] == BOS_ID)
    per_slice = np.bincount(bos[bos % T != 0] // T, minlength=num)
    return int(per_slice.max()) + 1


def capacity_rows(pieces: int) -> int:
    """cu_seqlens length for at most `pieces` documents (0, one end per piece; padded rows are
    zero-length documents), rounded up so a slightly different corpus keeps the same key."""
    return -(-(pieces + 1) // CAPACITY_ROUND) * CAPACITY_ROUND


# ---------------------------------------------------------------- training stream

@dataclass(slots=True, frozen=True)
class SliceShape:
    """The shape of one rank's micro-batch: T tokens, documents cut at max_seq_len, C rows."""

    tokens: int
    max_seq_len: int
    cu_seqlens_rows: int


@dataclass(slots=True)
class StreamPosition:
    """Where the training stream stands: resumable exactly (saved in checkpoints)."""

    epoch: int = 0
    shard_pos: int = 0  # index into this epoch's shard order
    doc_pos: int = 0  # index into the current shard's document order
    slices: int = 0  # slices produced so far (all ranks)


class TrainStream:
    """The deterministic sequence of packed slices shared by every rank (pure numpy, no torch).

    Document order: each epoch visits the shards in a seeded order and each shard's documents in a
    seeded order (`shuffle=False` keeps file order). Shards load lazily; one is held at a time.
    """

    def __init__(self, shards: list[Path], seed: int = 0, shuffle: bool = True,
                 vocab_size: int = GPT2_VOCAB):
        if not shards:
            raise DataError(f"no training shards; {PREPARE_HINT}")
        self.shards, self.seed, self.shuffle, self.vocab_size = shards, seed, shuffle, vocab_size
        self.pos = StreamPosition()
        self._tokens: tuple | None = None  # (shard index, tokens, doc starts, doc lengths)
        self._view: tuple | None = None  # ((epoch, shard_pos), (tokens, starts, lens) in epoch order)

    def _order(self, n: int, *key: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, *key]).permutation(n)

    def _shard(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens, doc starts, doc lengths) of the current shard, documents in epoch order."""
        key = (self.pos.epoch, self.pos.shard_pos)
        if self._view is not None and self._view[0] == key:  # the hot path: one tuple compare
            return self._view[1]
        shard_idx = int(self._order(len(self.shards), self.pos.epoch)[self.pos.shard_pos])
        if self._tokens is None or self._tokens[0] != shard_idx:
            tokens = read_shard(self.shards[shard_idx], self.vocab_size).numpy()
            starts = np.flatnonzero(tokens == BOS_ID)
            if starts.size == 0:
                raise DataError(f"{self.shards[shard_idx]}: no BOS ({BOS_ID}) token: documents "
                                f"must each start with BOS; re-prepare it ({PREPARE_HINT})")
            self._tokens = (shard_idx, tokens, starts, np.diff(np.append(starts, tokens.size)))
        _, tokens, starts, lens = self._tokens
        order = self._order(starts.size, self.pos.epoch, shard_idx)
        self._view = (key, (tokens, starts[order], lens[order]))
        return self._view[1]

    def _advance_doc(self, num_docs: int) -> None:
        self.pos.doc_pos += 1
        if self.pos.doc_pos == num_docs:
            self.pos.doc_pos = 0
            self.pos.shard_pos += 1
            if self.pos.shard_pos == len(self.shards):
                self.pos.shard_pos = 0
                self.pos.epoch += 1

    def next_slice(self, shape: SliceShape, out_tokens: np.ndarray | None = None,
                   out_cu: np.ndarray | None = None) -> None:
        """Advance over one slice of T + 1 tokens; with out arrays, also write it.

        out_tokens int32 [T + 1], out_cu int32 [C]. Skipping (no out arrays) walks the same
        documents without copying: ranks skip the slices other ranks own.
        """
        need, filled, pieces = shape.tokens + 1, 0, 0
        while filled < need:
            tokens, starts, lens = self._shard()
            d = self.pos.doc_pos
            take = min(int(lens[d]), shape.max_seq_len, need - filled)
            if pieces + 1 > shape.cu_seqlens_rows - 1:
                raise DataError(
                    f"slice {self.pos.slices}: a batch of {shape.tokens} tokens needs more than "
                    f"{shape.cu_seqlens_rows - 1} documents, the capacity of this key's "
                    f"cu_seqlens ({shape.cu_seqlens_rows} rows); raise --doc-capacity or drop it "
                    f"(the trainer then sizes it from the data)")
            if out_tokens is not None:
                out_tokens[filled:filled + take] = tokens[starts[d]:starts[d] + take]
                out_cu[pieces] = filled
            filled += take
            pieces += 1
            self._advance_doc(starts.size)
        if out_cu is not None:
            out_cu[pieces:] = shape.tokens
        self.pos.slices += 1

    def state_dict(self) -> dict:
        return dataclasses.asdict(self.pos)

    def load_state_dict(self, state: dict) -> None:
        self.pos = StreamPosition(**state)


# ---------------------------------------------------------------- background loader

@dataclass(slots=True)
class _Slot:
    """One pinned host buffer set of the loader's ring (sized for the largest shape)."""

    tokens: Tensor  # int32 [T_max + 1]
    targets: Tensor  # int64 [T_max]
    cu: Tensor  # int32 [C_max]
    copied: torch.cuda.Event | None = None  # recorded after the last H2D copy that read this slot


@dataclass(slots=True)
class _Item:
    step: int
    micro: int
    shape: SliceShape
    slot: _Slot
    position_after_step: dict | None  # stream position at the start of step + 1 (last micro only)


class BatchLoader:
    """A thread that packs this rank's micro-batches ahead into a ring of pinned buffers.

    `shape_for_step(step)` gives the SliceShape of a step (from the schedule). Each step yields
    `micro_steps` batches in order. `next_batch()` returns device tensors (fresh allocations, owned
    by the caller); the ring slot it read is refilled only after the copy's event completes.
    `state_dict()` is the position at the next step boundary the caller reached.
    """

    def __init__(self, stream: TrainStream, shape_for_step: Callable[[int], SliceShape],
                 rank: int, world_size: int, device: torch.device, *, start_step: int = 0,
                 ring_size: int = 4, max_shape: SliceShape | None = None,
                 slices_per_step: int = REFERENCE_WORLD_SIZE):
        if slices_per_step % world_size:
            raise ValueError(f"world_size {world_size} must divide {slices_per_step}: the per-rank "
                             f"shapes are defined for {slices_per_step} ranks")
        self.stream, self.shape_for_step = stream, shape_for_step
        self.slices_per_step = slices_per_step
        self.micro_steps = slices_per_step // world_size
        self.own = range(rank * self.micro_steps, (rank + 1) * self.micro_steps)
        self.device = device
        self.next_step = start_step
        self._resume_state = {"step": start_step, "stream": stream.state_dict()}
        shape = max_shape or shape_for_step(start_step)
        pin = device.type == "cuda"
        self._free: queue.Queue[_Slot] = queue.Queue()
        for _ in range(ring_size):
            self._free.put(_Slot(torch.empty(shape.tokens + 1, dtype=torch.int32, pin_memory=pin),
                                 torch.empty(shape.tokens, dtype=torch.int64, pin_memory=pin),
                                 torch.empty(shape.cu_seqlens_rows, dtype=torch.int32, pin_memory=pin)))
        self._ready: queue.Queue[_Item | BaseException] = queue.Queue(maxsize=ring_size)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name="batch-loader", daemon=True)
        self._thread.start()

    def _fill_slot(self, step: int, shape: SliceShape) -> _Slot:
        slot = self._free.get()
        if slot.copied is not None:
            slot.copied.synchronize()  # never overwrite what a pending copy still reads
        if slot.tokens.numel() < shape.tokens + 1 or slot.cu.numel() < shape.cu_seqlens_rows:
            raise ValueError(f"step {step}: shape {shape} exceeds the loader's max_shape")
        self.stream.next_slice(shape, slot.tokens[:shape.tokens + 1].numpy(),
                               slot.cu[:shape.cu_seqlens_rows].numpy())
        slot.targets[:shape.tokens].copy_(slot.tokens[1:shape.tokens + 1])
        return slot

    def _produce(self) -> None:
        step = self.next_step
        try:
            while not self._stop.is_set():
                shape = self.shape_for_step(step)
                for j in range(self.own.start):  # slices of lower ranks
                    self.stream.next_slice(shape)
                for micro in range(self.micro_steps):
                    if self._stop.is_set():
                        return
                    slot = self._fill_slot(step, shape)
                    after = None
                    if micro == self.micro_steps - 1:
                        for j in range(self.own.stop, self.slices_per_step):  # higher ranks
                            self.stream.next_slice(shape)
                        after = {"step": step + 1, "stream": self.stream.state_dict()}
                    self._put(_Item(step, micro, shape, slot, after))
                step += 1
        except BaseException as e:  # surfaced to the consumer, never swallowed
            self._put(e)

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._ready.put(item, timeout=0.1)
                return
            except queue.Full:
                continue
        if isinstance(item, _Item):
            self._free.put(item.slot)

    def next_batch(self) -> Batch:
        """The next micro-batch on the device (non_blocking copies from the pinned slot)."""
        item = self._ready.get()
        if isinstance(item, BaseException):
            raise item
        s, T, C = item.slot, item.shape.tokens, item.shape.cu_seqlens_rows
        nb = self.device.type == "cuda"
        batch = Batch(s.tokens[:T].to(self.device, non_blocking=nb, copy=True),
                      s.targets[:T].to(self.device, non_blocking=nb, copy=True),
                      s.cu[:C].to(self.device, non_blocking=nb, copy=True))
        if nb:
            s.copied = torch.cuda.Event()
            s.copied.record()
        self._free.put(s)
        if item.position_after_step is not None:
            self._resume_state = item.position_after_step
            self.next_step = item.step + 1
        return batch

    @property
    def epoch(self) -> int:
        """Epoch of the producer (it runs at most ring_size slices ahead of the consumer)."""
        return self.stream.pos.epoch

    def state_dict(self) -> dict:
        """Resume point: the first step not yet fully consumed and the stream position there."""
        return dict(self._resume_state)

    def close(self) -> None:
        """Stop the thread; unconsumed batches are dropped (state_dict() is unaffected)."""
        self._stop.set()
        while self._thread.is_alive():
            try:
                item = self._ready.get(timeout=0.05)
            except queue.Empty:
                continue
            if isinstance(item, _Item):
                self._free.put(item.slot)  # unblocks a producer waiting for a slot
        self._thread.join()


def make_train_loader(data_dir: str | os.PathLike, shape_for_step: Callable[[int], SliceShape],
                      rank: int, world_size: int, device: torch.device, *, seed: int,
                      max_shape: SliceShape, shuffle: bool = True, state: dict | None = None,
                      slices_per_step: int = REFERENCE_WORLD_SIZE) -> BatchLoader:
    """A BatchLoader over `data_dir`'s train shards, resumed from `state` if given."""
    stream = TrainStream(list_shards(data_dir, "train"), seed=seed, shuffle=shuffle)
    start = 0
    if state is not None:
        stream.load_state_dict(state["stream"])
        start = state["step"]
    return BatchLoader(stream, shape_for_step, rank, world_size, device, start_step=start,
                       max_shape=max_shape, slices_per_step=slices_per_step)


# ---------------------------------------------------------------- validation

def load_val_tokens(data_dir: str | os.PathLike, max_tokens: int | None = None) -> np.ndarray:
    """The validation tokens (all val shards concatenated, cut to max_tokens), uint16 [N]."""
    parts = [read_shard(p).numpy() for p in list_shards(data_dir, "val")]
    tokens = np.concatenate(parts) if len(parts) > 1 else parts[0]
    return tokens[:max_tokens] if max_tokens else tokens


def val_batches(tokens: np.ndarray, tokens_per_batch: int, cu_seqlens_rows: int, rank: int,
                world_size: int, device: torch.device) -> Iterator[Batch]:
    """Contiguous (not BOS-aligned) validation slices; slice i goes to rank i % world_size.

    cum_seqlens marks 0 and every BOS inside the slice, padded with T. Every token of
    tokens[:num_slices * T + 1] is predicted exactly once across ranks.
    """
    T = tokens_per_batch
    num_slices = (tokens.size - 1) // T
    if num_slices == 0:
        raise DataError(f"validation set has {tokens.size} tokens, fewer than one batch of {T}; "
                        f"lower the val batch size")
    for i in range(rank, num_slices, world_size):
        buf = tokens[i * T:(i + 1) * T + 1].astype(np.int64)
        starts = np.flatnonzero(buf[:-1] == BOS_ID)
        starts = starts[starts > 0]
        if starts.size + 2 > cu_seqlens_rows:
            raise DataError(f"validation slice {i} has {starts.size + 1} documents, more than the "
                            f"val cu_seqlens capacity {cu_seqlens_rows - 1}; raise --doc-capacity or drop it")
        cu = np.full(cu_seqlens_rows, T, dtype=np.int32)
        cu[0] = 0
        cu[1:1 + starts.size] = starts
        yield Batch(torch.from_numpy(buf[:-1].astype(np.int32)).to(device),
                    torch.from_numpy(buf[1:]).to(device), torch.from_numpy(cu).to(device))


def num_val_slices(num_tokens: int, tokens_per_batch: int) -> int:
    return (num_tokens - 1) // tokens_per_batch
