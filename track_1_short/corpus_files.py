"""`--source files`: the user's own text files -> GPT-2 train/val shards (default data/files).

Inputs (`--input GLOB [GLOB ...]`): each glob is expanded with glob.glob(recursive=True) (`**`
recurses), its matches sorted, directories skipped, a file matched twice read once; globs keep
the order given. By extension (any case):
  .txt      one document per file: the whole file, UTF-8 (a leading UTF-8 BOM is dropped)
  .jsonl    one document per non-blank line: a JSON object whose `--text-field` (default `text`)
            is a non-empty string
  .parquet  one document per row of the string column `--text-field`, read through pyarrow, an
            optional dependency (`pip install pyarrow`; the project's `test` extras install it)
Every document becomes [BOS=50256, GPT-2 ids...] (prepare_common.encode_batch).

Two passes over the input. The scan parses and checks everything and counts the documents,
writing nothing, so a bad file fails in seconds, before any shard, with an error (exit code 2)
that names the file, the line (.jsonl, .txt) or row index (.parquet, from 0) and the fix. Then
the write pass reads the files again, tokenizes in chunks (a tqdm bar on stderr) and streams the
documents into `files_train_NNNNNN.bin` shards of at most `shard_tokens` tokens and
`files_val_NNNNNN.bin` (prepare_common.ShardWriter): memory holds one shard and one chunk of text,
not the corpus.

Validation, whole documents only: `--val-fraction F` (default 0.01) holds out round(F * N) of
the N input documents, at least one, chosen by a generator seeded with `--seed`, in input order;
or `--val-input GLOB ...` takes every document of those files (a file in both lists is an error).
A split that leaves no training document is an error.

Idempotence (prepare_common): the manifest's settings hold this config and every input file's
resolved path, size and mtime, so re-running with the same files does nothing and a changed,
added or removed file rebuilds.

Document lengths: nothing here joins or splits the user's documents. The stats record the most
documents one speedrun micro-batch of this corpus can hold per stage
(prepare_common.speedrun_doc_counts); the trainer sizes its per-key document capacity from the
data, so a corpus of short documents trains as it is.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
from tqdm import tqdm

from track_1_short.data import DataError
from track_1_short.prepare_common import (DEFAULT_SHARD_TOKENS, DEFAULT_VAL_SEED, ShardWriter,
                                          complete_stats, encode_batch,
                                          speedrun_doc_counts, start_build, write_manifest)

PREFIX = "files"
DEFAULT_TEXT_FIELD = "text"
DEFAULT_VAL_FRACTION = 0.01
SUFFIXES = (".txt", ".jsonl", ".parquet")
CHUNK_DOCS, CHUNK_CHARS = 256, 8_000_000  # texts per encode_batch call, at most
PARQUET_BATCH_ROWS = 1024


@dataclass(slots=True, kw_only=True)
class FilesCorpusConfig:
    inputs: tuple[str, ...]  # globs of training files
    val_inputs: tuple[str, ...] = ()  # globs of validation files; empty: hold out val_fraction
    val_fraction: float | None = None  # None: DEFAULT_VAL_FRACTION when val_inputs is empty
    text_field: str = DEFAULT_TEXT_FIELD  # .jsonl key / .parquet column of the text
    seed: int = DEFAULT_VAL_SEED  # picks the held-out validation documents
    shard_tokens: int = DEFAULT_SHARD_TOKENS  # train shards hold at most this many tokens

    def __post_init__(self):
        if not self.inputs:
            raise ValueError("--input needs at least one GLOB")
        if self.val_inputs and self.val_fraction is not None:
            raise ValueError("--val-fraction and --val-input exclude each other; pass one")
        if not self.val_inputs and self.val_fraction is None:
            self.val_fraction = DEFAULT_VAL_FRACTION
        if self.val_fraction is not None and not 0 < self.val_fraction < 1:
            raise ValueError(f"--val-fraction must be in (0, 1), got {self.val_fraction}")
        if not self.text_field:
            raise ValueError("--text-field must not be empty")
        if self.shard_tokens < 1:
            raise ValueError(f"--shard-tokens must be >= 1, got {self.shard_tokens}")


# ---------------------------------------------------------------- inputs

def resolve_inputs(globs: tuple[str, ...], flag: str) -> list[Path]:
    """The files the globs match, in order, each once; a clear error for an empty glob or an
    unsupported extension."""
    paths: dict[Path, None] = {}
    for pattern in globs:
        matches = sorted(Path(m) for m in glob.glob(pattern, recursive=True))
        files = [m for m in matches if not m.is_dir()]
        if not files:
            found = f" ({len(matches)} directories, no files)" if matches else ""
            raise DataError(f"{flag} {pattern!r} matched no files{found}; check the path, and quote "
                            f"the glob so the shell passes it unexpanded (e.g. 'corpus/**/*.jsonl')")
        for path in files:
            if path.suffix.lower() not in SUFFIXES:
                raise DataError(f"{path}: unsupported extension {path.suffix or '(none)'!r}; "
                                f"{flag} takes .txt (one document per file), .jsonl (one per line) "
                                f"or .parquet (one per row) files: narrow the glob or convert it")
            paths.setdefault(Path(os.path.abspath(path)))  # a symlink keeps its own name
    return list(paths)


def _cannot_read(path: Path, e: Exception) -> DataError:
    reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    return DataError(f"{path}: cannot read: {reason}; check that it exists and is readable")


def _not_utf8(path: Path, line: int, byte: int) -> DataError:
    return DataError(f"{path}: line {line}: byte 0x{byte:02x} is not UTF-8; re-encode the file "
                     f"as UTF-8 (e.g. `iconv -f latin1 -t utf-8 IN > OUT`)")


def _txt_documents(path: Path, field: str) -> Iterator[str]:
    """The whole file (`field` is unused: the readers share one signature)."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise _cannot_read(path, e) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _not_utf8(path, raw.count(b"\n", 0, e.start) + 1, raw[e.start]) from None
    text = text.removeprefix("\ufeff")
    if not text.strip():
        raise DataError(f"{path}: empty file (whitespace only); a .txt file is one document: "
                        f"remove it or narrow the glob")
    yield text


def _jsonl_text(path: Path, line: int, raw: bytes, field: str) -> str | None:
    """The text of one .jsonl line (None for a blank line)."""
    try:
        s = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _not_utf8(path, line, raw[e.start]) from None
    if not s.strip():
        return None
    try:
        obj = json.loads(s)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: line {line}: not JSON ({e.msg}, column {e.colno}); each line of "
                        f"a .jsonl file is one JSON object like {{\"{field}\": \"...\"}}") from None
    if not isinstance(obj, dict) or field not in obj:
        what = (f"keys: {', '.join(list(obj)[:8])}" if isinstance(obj, dict)
                else f"a JSON {type(obj).__name__}")
        raise DataError(f"{path}: line {line}: no \"{field}\" field ({what}); pass "
                        f"--text-field NAME for the field that holds the text")
    text = obj[field]
    if not isinstance(text, str):
        raise DataError(f"{path}: line {line}: \"{field}\" is a JSON {type(text).__name__}, "
                        f"not a string")
    if not text.strip():
        raise DataError(f"{path}: line {line}: \"{field}\" is empty; remove the line")
    return text


def _jsonl_documents(path: Path, field: str) -> Iterator[str]:
    try:
        f = open(path, "rb")
    except OSError as e:
        raise _cannot_read(path, e) from None
    with f:
        for line, raw in enumerate(f, 1):
            text = _jsonl_text(path, line, raw, field)
            if text is not None:
                yield text


def _parquet_file(path: Path, field: str):
    """(pyarrow, a ParquetFile whose `field` column is text); clear errors otherwise."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading .parquet files needs pyarrow, which is not installed: "
                        f"`pip install pyarrow` (or convert the file to .jsonl)") from None
    try:
        pf = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise _cannot_read(path, e) from None
    schema = pf.schema_arrow
    if field not in schema.names:
        raise DataError(f"{path}: no column \"{field}\" (columns: {', '.join(schema.names[:8])}); "
                        f"pass --text-field NAME for the column that holds the text")
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise DataError(f"{path}: column \"{field}\" is {kind}, not a string column; pass "
                        f"--text-field NAME for the column that holds the text")
    return pa, pf


def _parquet_documents(path: Path, field: str) -> Iterator[str]:
    pa, pf = _parquet_file(path, field)
    row = 0
    try:
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[field]):
            for text in batch.column(0).to_pylist():
                if text is None or not text.strip():
                    raise DataError(f"{path}: row {row} (from 0): \"{field}\" is "
                                    f"{'null' if text is None else 'empty'}; drop the row")
                row += 1
                yield text
    except (OSError, pa.ArrowException) as e:
        raise _cannot_read(path, e) from None


_READERS = {".txt": _txt_documents, ".jsonl": _jsonl_documents, ".parquet": _parquet_documents}


def iter_documents(path: Path, field: str) -> Iterator[str]:
    """The documents of one input file, in file order (a DataError naming file and line/row)."""
    return _READERS[path.suffix.lower()](path, field)


def scan(paths: list[Path], field: str, flag: str) -> int:
    """Parse and check every document of paths (nothing written); return the document count."""
    num_docs = 0
    for path in tqdm(paths, desc=f"scan {flag}", unit="file", file=sys.stderr):
        num_docs += sum(1 for _ in iter_documents(path, field))
    if num_docs == 0:
        raise DataError(f"{flag} matched {len(paths)} file(s) ({', '.join(map(str, paths[:3]))}"
                        f"{' ...' if len(paths) > 3 else ''}) but they hold no documents (blank "
                        f".jsonl files, parquet files without rows); check the files")
    return num_docs


# ---------------------------------------------------------------- split and write

def val_mask(num_docs: int, cfg: FilesCorpusConfig) -> np.ndarray:
    """bool [num_docs]: True for the held-out validation documents (none with val_inputs)."""
    mask = np.zeros(num_docs, dtype=bool)
    if cfg.val_inputs:
        return mask
    num_val = max(1, round(cfg.val_fraction * num_docs))
    if num_val >= num_docs:
        raise DataError(f"--val-fraction {cfg.val_fraction} of {num_docs} document(s) holds out "
                        f"{num_val} (at least one), leaving no training documents; add documents "
                        f"or pass separate validation files with --val-input GLOB")
    mask[np.random.default_rng(cfg.seed).choice(num_docs, size=num_val, replace=False)] = True
    return mask


def tokenized(paths: list[Path], field: str, bar: tqdm) -> Iterator[np.ndarray]:
    """Every document of paths in order as uint16 [BOS, ids...], encoded in chunks."""
    chunk, chars = [], 0
    for path in paths:
        for text in iter_documents(path, field):
            chunk.append(text)
            chars += len(text)
            if len(chunk) >= CHUNK_DOCS or chars >= CHUNK_CHARS:
                yield from encode_batch(chunk)
                bar.update(len(chunk))
                chunk, chars = [], 0
    if chunk:
        yield from encode_batch(chunk)
        bar.update(len(chunk))


def files_settings(cfg: FilesCorpusConfig, train: list[Path], val: list[Path]) -> dict:
    def files(paths: list[Path]) -> list[list]:
        out = []
        for p in paths:
            try:
                st = p.stat()
            except OSError as e:
                raise _cannot_read(p, e) from None
            out.append([str(p), st.st_size, st.st_mtime_ns])
        return out

    return {"source": "files", "inputs": files(train), "val_inputs": files(val),
            "text_field": cfg.text_field, "val_fraction": cfg.val_fraction, "seed": cfg.seed,
            "shard_tokens": cfg.shard_tokens}


def _write(out_dir: Path, cfg: FilesCorpusConfig, train: list[Path], val: list[Path],
           counts: tuple[int, int]) -> tuple[ShardWriter, ShardWriter]:
    """The write pass: tokenize every document and stream it into its split's shards."""
    is_val = val_mask(counts[0], cfg)
    writers = (ShardWriter(out_dir, PREFIX, "train", cfg.shard_tokens),
               ShardWriter(out_dir, PREFIX, "val", cfg.shard_tokens))
    changed = DataError("the input files changed between the scan and the write pass; run "
                        "prepare again once nothing writes to them")
    seen = [0, 0]
    with tqdm(total=sum(counts), desc="tokenize files", unit="doc", file=sys.stderr) as bar:
        for split, paths in enumerate((train, val)):
            for doc in tokenized(paths, cfg.text_field, bar):
                if seen[split] == counts[split]:
                    raise changed
                writers[1 if split else int(is_val[seen[0]])].add(doc)
                seen[split] += 1
    if tuple(seen) != counts:
        raise changed
    for w in writers:
        w.close()
    return writers


def prepare_files(out_dir: Path, cfg: FilesCorpusConfig, force: bool = False) -> dict:
    train = resolve_inputs(cfg.inputs, "--input")
    val = resolve_inputs(cfg.val_inputs, "--val-input") if cfg.val_inputs else []
    if both := set(train) & set(val):
        raise DataError(f"{sorted(both)[0]}: matched by both --input and --val-input; a file "
                        f"belongs to one split")
    settings = files_settings(cfg, train, val)
    if (done := complete_stats(out_dir, settings, force)) is not None:
        return done
    t0 = time.perf_counter()
    counts = (scan(train, cfg.text_field, "--input"),
              scan(val, cfg.text_field, "--val-input") if val else 0)
    start_build(out_dir, PREFIX)
    train_w, val_w = _write(out_dir, cfg, train, val, counts)
    stats = {"files": len(train) + len(val), **train_w.stats(), **val_w.stats(),
             "min_doc_tokens": int(min(train_w.doc_lens)),
             "speedrun_docs_per_batch": speedrun_doc_counts(np.asarray(train_w.doc_lens)),
             "build_s": round(time.perf_counter() - t0, 1)}
    write_manifest(out_dir, settings, {**train_w.shards, **val_w.shards}, stats)
    print(f"prepare: wrote {out_dir}: {train_w.num_tokens:,} train tokens in {len(train_w.doc_lens):,} "
          f"documents, {val_w.num_tokens:,} val tokens in {len(val_w.doc_lens):,} documents")
    return stats
