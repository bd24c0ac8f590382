"""Tokenizer: the real GPT-2 BPE, offline, from tiktoken's cache or the pinned whisper file.
CPU only; run: pytest tests/test_tokenizer.py"""

from pathlib import Path

import pytest

from track_1_short import tokenizer
from track_1_short.model.tokens import GPT2_VOCAB


def test_hello_world_and_eot():
    enc = tokenizer.get_encoding()
    assert enc.encode("Hello world") == [15496, 995]
    assert enc.encode("<|endoftext|>", allowed_special="all") == [tokenizer.EOT_ID] == [50256]
    assert enc.n_vocab == GPT2_VOCAB


def test_whisper_file_matches_pin_and_tiktoken_ranks():
    path = tokenizer.whisper_bpe_path()
    assert path is not None, "openai-whisper must be installed (scripts/env.sh installs it)"
    enc = tokenizer.encoding_from_file(path)
    text = "The quick brown fox — naïve café, 東京, 🙂\n\n  indented\tcode()"
    assert enc.encode_ordinary(text) == tokenizer.get_encoding().encode_ordinary(text)
    assert enc.decode(enc.encode_ordinary(text)) == text


def test_hash_mismatch_is_an_error(tmp_path: Path):
    bad = tmp_path / "gpt2.tiktoken"
    bad.write_bytes(tokenizer.whisper_bpe_path().read_bytes()[:-10] + b"corrupted\n")
    with pytest.raises(tokenizer.TokenizerError, match="sha256"):
        tokenizer.encoding_from_file(bad)


def test_tiktoken_cache_is_preferred(tmp_path: Path, monkeypatch):
    # tiktoken names cache files by the sha1 of the source URL; the r50k file is the whisper file.
    cache_name = tokenizer._CACHE_NAMES["r50k_base"][0]
    (tmp_path / cache_name).write_bytes(tokenizer.whisper_bpe_path().read_bytes())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    assert tokenizer._cached_encoding_name() == "r50k_base"
    tokenizer.get_encoding.cache_clear()
    try:
        assert tokenizer.get_encoding().encode("Hello world") == [15496, 995]
    finally:
        tokenizer.get_encoding.cache_clear()


def test_missing_everything_names_the_fix(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tokenizer, "whisper_bpe_path", lambda: None)
    tokenizer.get_encoding.cache_clear()
    try:
        with pytest.raises(tokenizer.TokenizerError, match="openai-whisper"):
            tokenizer.get_encoding()
    finally:
        tokenizer.get_encoding.cache_clear()


def test_encode_document_starts_with_bos():
    assert tokenizer.encode_document("Hello world") == [50256, 15496, 995]
