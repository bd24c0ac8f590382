"""What every prepare source shares: the manifest (completeness and idempotence), the streaming
shard writer, GPT-2 tokenization of documents, and the corpus's documents-per-batch statistic.

What it replaces: the manifest helpers and the tokenize loop that prepare.py held for its two
sources; the `files` (corpus_files.py) and `embedded-large` (corpus_large.py) sources use the same
code, so every source has the same guarantees:
- Atomic: every shard goes through data.write_shard (temp file + rename), and `manifest.json` is
  written last (temp + rename), so a dir without a manifest is incomplete, whatever it holds.
- Idempotent: `complete_stats(out_dir, settings)` returns the recorded stats (and the caller does
  nothing) when the manifest's settings equal this run's and every listed shard's header and size
  check out; anything else rebuilds. `start_build` removes the manifest first, then the source's
  own earlier shards (`{prefix}_train_*.bin`, `{prefix}_val_*.bin`), so a rebuild that writes fewer
  shards leaves none of the old ones for data.list_shards to pick up.
- Bounded memory: `ShardWriter` takes whole documents and writes `{prefix}_{split}_NNNNNN.bin`
  shards of at most `shard_tokens` tokens (one document longer than that gets a shard of its own:
  a shard never splits a document, since data.TrainStream reads documents from BOS positions).

Documents per batch (schedule.SPEEDRUN_STAGES): a micro-batch of T tokens packs whole-document
pieces, each cut to the stage's max_seq_len; over every document order the most pieces a slice can
hold is the count of the shortest documents that together fill T + 1 tokens
(data.worst_case_pieces). The stats record it per stage; the trainer sizes each key's capacity
from it at start, so no corpus is refused for short documents.
"""

from __future__ import annotations

import array
import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from track_1_short import tokenizer
from track_1_short.data import BOS_ID, DataError, read_header, worst_case_pieces, write_shard
from track_1_short.schedule import SPEEDRUN_STAGES

MANIFEST = "manifest.json"
DEFAULT_VAL_SEED = 1234  # picks held-out validation documents
DEFAULT_SHARD_TOKENS = 100_000_000  # like FineWeb's train shards
TOKENIZE_CHUNK_DOCS = 256  # documents per encode_ordinary_batch call (one progress-bar update)


# ---------------------------------------------------------------- manifest

def manifest_ok(out_dir: Path, expect: dict) -> bool:
    """True when out_dir holds a complete prepare with the same settings and valid shards."""
    path = out_dir / MANIFEST
    if not path.is_file():
        return False
    manifest = json.loads(path.read_text())
    if manifest.get("settings") != expect:
        return False
    try:
        for name, count in manifest["shards"].items():
            if read_header(out_dir / name) != count:
                return False
    except (OSError, DataError):
        return False
    return True


def complete_stats(out_dir: Path, settings: dict, force: bool) -> dict | None:
    """The recorded stats when out_dir is already complete with these settings (and not force)."""
    if force or not manifest_ok(out_dir, settings):
        return None
    print(f"prepare: {out_dir} is complete, nothing to do (--force rebuilds)")
    return json.loads((out_dir / MANIFEST).read_text())["stats"]


def start_build(out_dir: Path, prefix: str | None) -> None:
    """Mark out_dir incomplete (manifest removed first), then remove the prefix's earlier shards."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MANIFEST).unlink(missing_ok=True)
    if prefix is not None:
        for split in ("train", "val"):
            for old in out_dir.glob(f"{prefix}_{split}_*.bin*"):  # shards and interrupted temps
                old.unlink()


def write_manifest(out_dir: Path, settings: dict, shards: dict[str, int], stats: dict) -> None:
    tmp = out_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"settings": settings, "shards": shards, "stats": stats}, indent=1))
    os.replace(tmp, out_dir / MANIFEST)


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# ---------------------------------------------------------------- documents and tokens

def join_to_min(pieces: list[str], min_chars: int, sep: str) -> list[str]:
    """Join consecutive pieces into documents of at least min_chars (a short tail joins the last)."""
    docs, cur, cur_chars = [], [], 0
    for piece in pieces:
        cur.append(piece)
        cur_chars += len(piece)
        if cur_chars >= min_chars:
            docs.append(sep.join(cur))
            cur, cur_chars = [], 0
    if cur:
        if docs:
            docs[-1] = sep.join([docs[-1], *cur])
        else:
            docs.append(sep.join(cur))
    return docs


def encode_batch(texts: list[str]) -> list[np.ndarray]:
    """Each text as uint16 GPT-2 ids with one BOS (50256) first."""
    enc = tokenizer.get_encoding()
    threads = max(1, min(8, os.cpu_count() or 1))
    return [np.array([BOS_ID, *ids], dtype=np.uint16)
            for ids in enc.encode_ordinary_batch(texts, num_threads=threads)]


def tokenize_documents(docs: list[str], desc: str) -> list[np.ndarray]:
    """encode_batch over a list of documents, with a tqdm bar on stderr."""
    out = []
    with tqdm(total=len(docs), desc=f"tokenize {desc}", unit="doc", file=sys.stderr) as bar:
        for i in range(0, len(docs), TOKENIZE_CHUNK_DOCS):
            out += encode_batch(docs[i:i + TOKENIZE_CHUNK_DOCS])
            bar.update(len(docs[i:i + TOKENIZE_CHUNK_DOCS]))
    return out


# ---------------------------------------------------------------- shard writer

class ShardWriter:
    """Whole documents (uint16, BOS first) -> `{prefix}_{split}_NNNNNN.bin` shards, streaming.

    Holds at most one shard's tokens (`shard_tokens`, uint16) in memory. `close()` writes the
    last partial shard and returns {shard name: token count}. Also kept: the document count and
    lengths (for the capacity check), the token total, and the sha256 of each shard file.
    """

    def __init__(self, out_dir: Path, prefix: str, split: str, shard_tokens: int):
        if shard_tokens < 1:
            raise ValueError(f"--shard-tokens must be >= 1, got {shard_tokens}")
        self.out_dir, self.prefix, self.split, self.shard_tokens = out_dir, prefix, split, shard_tokens
        self._buf = np.empty(0, dtype=np.uint16)  # grows up to shard_tokens
        self._fill = 0
        self.shards: dict[str, int] = {}
        self.sha256: dict[str, str] = {}
        self.doc_lens = array.array("I")  # 4 bytes per document: 10M documents in 40 MB
        self.num_tokens = 0

    def add(self, doc: np.ndarray) -> None:
        if doc.size == 0 or doc[0] != BOS_ID:
            raise ValueError("ShardWriter.add takes documents that start with BOS")
        self.doc_lens.append(int(doc.size))
        self.num_tokens += int(doc.size)
        if self._fill and self._fill + doc.size > self.shard_tokens:
            self._flush()
        if doc.size > self.shard_tokens:  # a document longer than a shard gets its own
            self._write(doc)
            return
        if self._fill + doc.size > self._buf.size:
            grown = np.empty(min(self.shard_tokens, max(2 * self._buf.size, self._fill + doc.size)),
                             dtype=np.uint16)
            grown[:self._fill] = self._buf[:self._fill]
            self._buf = grown
        self._buf[self._fill:self._fill + doc.size] = doc
        self._fill += doc.size

    def _flush(self) -> None:
        self._write(self._buf[:self._fill])
        self._fill = 0

    def _write(self, tokens: np.ndarray) -> None:
        name = f"{self.prefix}_{self.split}_{len(self.shards):06d}.bin"
        write_shard(self.out_dir / name, tokens)
        self.shards[name] = int(tokens.size)
        self.sha256[name] = file_sha256(self.out_dir / name)

    def close(self) -> dict[str, int]:
        if self._fill:
            self._flush()
        self._buf = np.empty(0, dtype=np.uint16)
        return self.shards

    def stats(self) -> dict:
        """{split}_docs, {split}_tokens, {split}_shards: {name: tokens, size in MB, sha256}."""
        shards = {name: {"tokens": count, "mb": round((self.out_dir / name).stat().st_size / 1e6, 3),
                         "sha256": self.sha256[name]} for name, count in self.shards.items()}
        return {f"{self.split}_docs": len(self.doc_lens), f"{self.split}_tokens": self.num_tokens,
                f"{self.split}_shards": shards}


# ---------------------------------------------------------------- documents per batch

def speedrun_doc_counts(doc_lens: np.ndarray) -> dict[str, dict]:
    """Per speedrun stage: the most documents one micro-batch of this corpus can hold over every
    document order (data.worst_case_pieces), a statistic of the corpus: the trainer sizes each
    key's document capacity from the data it trains on (trainer/preflight.py)."""
    return {s.name: {"tokens": s.tokens_per_rank, "max_seq_len": s.max_seq_len,
                     "max_docs_per_batch": worst_case_pieces(doc_lens, s.tokens_per_rank,
                                                             s.max_seq_len)}
            for s in SPEEDRUN_STAGES}
