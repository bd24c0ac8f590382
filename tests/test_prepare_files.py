"""prepare --source files: the user's .txt / .jsonl / .parquet files -> shards, end to end through
the CLI (tiny files in tmp_path): each format, BOS per document, validation held out by whole
document, streaming shards, idempotence and --force, and every bad input (exit code 2, the
message names the file and line). Parquet tests need pyarrow (the `test` extras install it) and
are skipped without it. CPU only, a few seconds; run: pytest tests/test_prepare_files.py"""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from track_1_short import corpus_files, prepare, tokenizer
from track_1_short.data import BOS_ID, SliceShape, TrainStream, list_shards, read_shard
from track_1_short.prepare_common import MANIFEST


def _texts(n: int, tag: str = "doc") -> list[str]:
    return [f"{tag} {i}: " + " ".join(f"word{i * 7 + j}" for j in range(5 + i % 4)) for i in range(n)]


def _prepare(tmp_path: Path, *args: str, out: str = "out") -> int:
    return prepare.main(["--source", "files", "--out-dir", str(tmp_path / out), *args])


def _split_docs(out: Path, split: str) -> list[str]:
    """Every document of a split, decoded, after checking each starts at BOS."""
    docs = []
    for shard in list_shards(out, split):
        tokens = read_shard(shard).numpy()
        assert tokens[0] == BOS_ID, f"{shard} does not start with BOS"
        starts = np.flatnonzero(tokens == BOS_ID)
        for a, b in zip(starts, list(starts[1:]) + [tokens.size]):
            docs.append(tokenizer.get_encoding().decode(tokens[a + 1:b].tolist()))
    return docs


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _check_split(out: Path, texts: list[str], num_val: int) -> tuple[list[str], list[str]]:
    train, val = _split_docs(out, "train"), _split_docs(out, "val")
    assert len(val) == num_val and len(train) == len(texts) - num_val
    assert sorted(train + val) == sorted(texts), "every document once, whole, in one split"
    assert not set(train) & set(val)
    return train, val


# ---------------------------------------------------------------- each format, end to end

def test_txt_files(tmp_path):
    texts = _texts(10, "txt")
    for i, text in enumerate(texts):
        (tmp_path / f"d{i:02d}.txt").write_text(text, encoding="utf-8")
    assert _prepare(tmp_path, "--input", str(tmp_path / "*.txt"), "--val-fraction", "0.2") == 0
    _check_split(tmp_path / "out", texts, num_val=2)
    stats = json.loads((tmp_path / "out" / MANIFEST).read_text())["stats"]
    assert stats["train_docs"] == 8 and stats["val_docs"] == 2 and stats["files"] == 10
    stream = TrainStream(list_shards(tmp_path / "out", "train"), seed=0)
    tokens, cu = np.zeros(65, dtype=np.int32), np.zeros(16, dtype=np.int32)
    stream.next_slice(SliceShape(tokens=64, max_seq_len=64, cu_seqlens_rows=16), tokens, cu)
    assert tokens[0] == BOS_ID


def test_jsonl_text_field_blank_lines_and_val_input(tmp_path):
    train_texts, val_texts = _texts(6, "train"), _texts(2, "val")
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps({"id": i, "body": t}) for i, t in enumerate(train_texts))
                    + "\n\n   \n", encoding="utf-8")  # blank lines are not documents
    _write_jsonl(tmp_path / "val.jsonl", [{"body": t} for t in val_texts])
    assert _prepare(tmp_path, "--input", str(path), "--val-input", str(tmp_path / "val.jsonl"),
                    "--text-field", "body") == 0
    train, val = _check_split(tmp_path / "out", train_texts + val_texts, num_val=2)
    assert sorted(val) == sorted(val_texts)


def test_parquet_rows(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    texts = _texts(9, "pq")
    pq.write_table(pa.table({"text": texts[:5], "n": list(range(5))}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"text": texts[5:], "n": list(range(4))}), tmp_path / "b.parquet")
    assert _prepare(tmp_path, "--input", str(tmp_path / "*.parquet"), "--val-fraction", "0.3") == 0
    _check_split(tmp_path / "out", texts, num_val=3)


def test_mixed_formats_recursive_glob_read_once(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.txt").write_text("alpha text", encoding="utf-8")
    _write_jsonl(tmp_path / "sub" / "b.jsonl", [{"text": "beta one"}, {"text": "beta two"}])
    glob = str(tmp_path / "**" / "*.*")
    assert _prepare(tmp_path, "--input", glob, glob, "--val-fraction", "0.3") == 0  # matched twice
    _check_split(tmp_path / "out", ["alpha text", "beta one", "beta two"], num_val=1)


def test_streaming_shards_hold_whole_documents(tmp_path):
    texts = _texts(40, "stream")
    _write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts])
    assert _prepare(tmp_path, "--input", str(tmp_path / "a.jsonl"), "--shard-tokens", "60") == 0
    shards = list_shards(tmp_path / "out", "train")
    assert [p.name for p in shards] == [f"files_train_{i:06d}.bin" for i in range(len(shards))]
    assert len(shards) > 5
    for shard in shards:
        tokens = read_shard(shard).numpy()
        assert tokens.size <= 60 and tokens[0] == BOS_ID
    _check_split(tmp_path / "out", texts, num_val=1)


def test_one_document_longer_than_a_shard_gets_its_own(tmp_path):
    long_text = " ".join(f"w{i}" for i in range(200))
    _write_jsonl(tmp_path / "a.jsonl", [{"text": "short a"}, {"text": long_text}, {"text": "short b"},
                                        {"text": "short c"}])
    assert _prepare(tmp_path, "--input", str(tmp_path / "a.jsonl"), "--shard-tokens", "20",
                    "--val-fraction", "0.25") == 0
    sizes = [read_shard(p).numel() for p in list_shards(tmp_path / "out", "train")]
    assert max(sizes) > 20 and sum(s > 20 for s in sizes) == 1


def test_val_split_is_seeded(tmp_path):
    texts = _texts(50, "seed")
    _write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts])
    vals = []
    for out, seed in (("s1", "1"), ("s1b", "1"), ("s2", "2")):
        assert _prepare(tmp_path, "--input", str(tmp_path / "a.jsonl"), "--val-fraction", "0.1",
                        "--seed", seed, out=out) == 0
        vals.append(sorted(_split_docs(tmp_path / out, "val")))
    assert len(vals[0]) == 5 and vals[0] == vals[1] and vals[0] != vals[2]


# ---------------------------------------------------------------- idempotence and --force

def test_idempotent_force_and_changed_input(tmp_path, capsys):
    path = _write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in _texts(30)])
    args = ("--input", str(path), "--shard-tokens", "100")
    assert _prepare(tmp_path, *args) == 0
    out = tmp_path / "out"
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.glob("*.bin")}
    capsys.readouterr()
    assert _prepare(tmp_path, *args) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert mtimes == {p.name: p.stat().st_mtime_ns for p in out.glob("*.bin")}
    assert _prepare(tmp_path, *args, "--force") == 0
    assert "nothing to do" not in capsys.readouterr().out
    assert all(p.stat().st_mtime_ns != mtimes[p.name] for p in out.glob("*.bin"))
    _write_jsonl(path, [{"text": t} for t in _texts(4)])  # a changed input rebuilds, fewer shards
    assert _prepare(tmp_path, *args) == 0
    assert "nothing to do" not in capsys.readouterr().out
    assert len(_split_docs(out, "train")) == 3, "no shard of the earlier build is left"
    assert set(json.loads((out / MANIFEST).read_text())["shards"]) == {p.name for p in out.glob("*.bin")}


def test_interrupted_build_is_not_complete(tmp_path, monkeypatch):
    path = _write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in _texts(30)])
    calls = []

    def interrupt(texts):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(texts)

    real = corpus_files.encode_batch
    monkeypatch.setattr(corpus_files, "CHUNK_DOCS", 4)
    monkeypatch.setattr(corpus_files, "encode_batch", interrupt)
    with pytest.raises(KeyboardInterrupt):
        _prepare(tmp_path, "--input", str(path), "--shard-tokens", "30")
    assert not (tmp_path / "out" / MANIFEST).exists() and not list((tmp_path / "out").glob("*.tmp*"))
    monkeypatch.setattr(corpus_files, "encode_batch", real)
    assert _prepare(tmp_path, "--input", str(path), "--shard-tokens", "30") == 0
    _check_split(tmp_path / "out", _texts(30), num_val=1)


def test_short_documents_are_kept_and_counted(tmp_path, capsys):
    """~10-token documents are written as they are (the trainer sizes its per-key document
    capacity from the data); the stats record the most a speedrun micro-batch can hold."""
    _write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in _texts(2500)])
    assert _prepare(tmp_path, "--input", str(tmp_path / "a.jsonl")) == 0
    assert "note:" not in capsys.readouterr().err
    stats = json.loads((tmp_path / "out" / MANIFEST).read_text())["stats"]
    assert stats["speedrun_docs_per_batch"]["A"]["max_docs_per_batch"] > 63


# ---------------------------------------------------------------- bad input: exit 2, names file and line

def _fails(tmp_path, capsys, *args: str) -> str:
    assert _prepare(tmp_path, *args) == 2
    out = tmp_path / "out"
    assert not (out / MANIFEST).exists() and not list(out.glob("*.bin")), "nothing written"
    return capsys.readouterr().err


def test_glob_without_matches(tmp_path, capsys):
    err = _fails(tmp_path, capsys, "--input", str(tmp_path / "nothing" / "*.jsonl"))
    assert "nothing/*.jsonl" in err and "matched no files" in err


def test_unreadable_file(tmp_path, capsys):
    (tmp_path / "gone.jsonl").symlink_to(tmp_path / "missing-target.jsonl")
    err = _fails(tmp_path, capsys, "--input", str(tmp_path / "gone.jsonl"))
    assert "gone.jsonl" in err and "cannot read" in err


def test_non_utf8_txt_names_line(tmp_path, capsys):
    (tmp_path / "bad.txt").write_bytes(b"line one\nline two\ncaf\xe9 line three\n")
    err = _fails(tmp_path, capsys, "--input", str(tmp_path / "bad.txt"))
    assert "bad.txt: line 3" in err and "UTF-8" in err


def test_non_utf8_jsonl_names_line(tmp_path, capsys):
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    err = _fails(tmp_path, capsys, "--input", str(tmp_path / "bad.jsonl"))
    assert "bad.jsonl: line 2" in err and "UTF-8" in err


@pytest.mark.parametrize("line,match", [
    ('{"text": "unterminated', "not JSON"),
    ('{"body": "no text key"}', 'no "text" field'),
    ('["a", "list"]', 'no "text" field'),
    ('{"text": 42}', "not a string"),
    ('{"text": "   "}', "is empty"),
])
def test_bad_jsonl_line(tmp_path, capsys, line, match):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n\n' + line + "\n", encoding="utf-8")
    err = _fails(tmp_path, capsys, "--input", str(tmp_path / "bad.jsonl"))
    assert "bad.jsonl: line 3" in err and match in err


def test_parquet_without_the_column(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["a", "b"]}), tmp_path / "x.parquet")
    err = _fails(tmp_path, capsys, "--input", str(tmp_path / "x.parquet"))
    assert "x.parquet" in err and 'no column "text"' in err and "body" in err and "--text-field" in err


def test_parquet_null_row_and_non_string_column(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a", "b", None]}), tmp_path / "x.parquet")
    err = _fails(tmp_path, capsys, "--input", str(tmp_path / "x.parquet"))
    assert "x.parquet: row 2" in err and "null" in err
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "x.parquet")
    assert "not a string column" in _fails(tmp_path, capsys, "--input", str(tmp_path / "x.parquet"))


def test_corrupt_parquet(tmp_path, capsys):
    pytest.importorskip("pyarrow")
    (tmp_path / "x.parquet").write_bytes(b"not a parquet file at all")
    err = _fails(tmp_path, capsys, "--input", str(tmp_path / "x.parquet"))
    assert "x.parquet" in err and "cannot read" in err


def test_parquet_without_pyarrow(tmp_path, capsys, monkeypatch):
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow -> ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    err = _fails(tmp_path, capsys, "--input", str(tmp_path / "x.parquet"))
    assert "x.parquet" in err and "pip install pyarrow" in err


def test_unsupported_extension(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("fine", encoding="utf-8")
    (tmp_path / "b.csv").write_text("text\nhello\n", encoding="utf-8")
    err = _fails(tmp_path, capsys, "--input", str(tmp_path / "*"))
    assert "b.csv" in err and "unsupported extension '.csv'" in err


def test_empty_txt_file(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("fine", encoding="utf-8")
    (tmp_path / "b.txt").write_text("  \n", encoding="utf-8")
    err = _fails(tmp_path, capsys, "--input", str(tmp_path / "*.txt"))
    assert "b.txt" in err and "empty file" in err


def test_corpus_without_documents(tmp_path, capsys):
    (tmp_path / "a.jsonl").write_text("\n\n", encoding="utf-8")
    err = _fails(tmp_path, capsys, "--input", str(tmp_path / "a.jsonl"))
    assert "a.jsonl" in err and "no documents" in err


def test_val_split_leaving_no_training_documents(tmp_path, capsys):
    _write_jsonl(tmp_path / "a.jsonl", [{"text": "the only document"}])
    err = _fails(tmp_path, capsys, "--input", str(tmp_path / "a.jsonl"))
    assert "--val-fraction" in err and "leaving no training documents" in err and "--val-input" in err
    _write_jsonl(tmp_path / "b.jsonl", [{"text": "one"}, {"text": "two"}])
    err = _fails(tmp_path, capsys, "--input", str(tmp_path / "b.jsonl"), "--val-fraction", "0.9")
    assert "leaving no training documents" in err


def test_same_file_in_both_splits(tmp_path, capsys):
    _write_jsonl(tmp_path / "a.jsonl", [{"text": "one"}, {"text": "two"}])
    err = _fails(tmp_path, capsys, "--input", str(tmp_path / "a.jsonl"), "--val-input",
                 str(tmp_path / "*.jsonl"))
    assert "a.jsonl" in err and "both --input and --val-input" in err


@pytest.mark.parametrize("args,match", [
    (["--source", "files"], "needs --input"),
    (["--source", "embedded", "--input", "x.jsonl"], "--input applies to --source files"),
    (["--source", "fineweb", "--seed", "3"], "--seed applies to"),
    (["--source", "files", "--input", "x", "--package-dir", "p"], "--package-dir applies to"),
    (["--source", "files", "--input", "x", "--val-fraction", "1.5"], "--val-fraction must be in"),
    (["--source", "files", "--input", "x", "--shard-tokens", "-5"], "--shard-tokens must be >= 1"),
])
def test_bad_flags(args, match, capsys):
    assert prepare.main(args) == 2
    assert match in capsys.readouterr().err


def test_val_fraction_and_val_input_exclude_each_other(capsys):
    with pytest.raises(SystemExit) as e:
        prepare.main(["--source", "files", "--input", "x", "--val-fraction", "0.1", "--val-input", "y"])
    assert e.value.code == 2 and "not allowed with" in capsys.readouterr().err


def test_help_lists_sources_and_flags(capsys):
    with pytest.raises(SystemExit):
        prepare.main(["--help"])
    out = capsys.readouterr().out
    for word in ("embedded-large", "files", "--input", "--text-field", "--val-fraction",
                 "--val-input", "--shard-tokens", "--package-dir", "apt-get"):
        assert word in out, word
