"""GPT-2 BPE through tiktoken, offline-capable.

What it replaces: `tiktoken.get_encoding("gpt2")`, which downloads the BPE files on first use and
so fails on a machine with no network (CI, the H200 machines, an air-gapped cluster).

How it finds the BPE, in order (the first that exists wins; nothing here touches the network):
1. tiktoken's own cache (`$TIKTOKEN_CACHE_DIR`, `$DATA_GYM_CACHE_DIR`, or `<tmp>/data-gym-cache`)
   holding the r50k_base file or the GPT-2 vocab.bpe + encoder.json pair: `tiktoken.get_encoding`
   then loads it and re-checks tiktoken's own sha256 pins.
2. The GPT-2 file shipped inside the registry package `openai-whisper==20250625`
   (`whisper/assets/gpt2.tiktoken`, byte-identical to tiktoken's r50k_base file), found with
   `importlib.util.find_spec` so whisper's own heavy imports never run, checked against the same
   sha256 pin that tiktoken uses. A mismatch is an error, never a silent fallback.
Provenance: shared reference embedded_data.md (checked by hand with no network).

Invariants the rest of the package relies on: "Hello world" -> [15496, 995]; `<|endoftext|>` ->
50256 (= model/tokens.BOS_ID, one before each document).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import tempfile
from pathlib import Path

import tiktoken

from track_1_short.model.tokens import BOS_ID

EOT_TOKEN = "<|endoftext|>"
EOT_ID = BOS_ID  # the end-of-text token is the BOS placed before every document

# tiktoken 0.14's own pins (tiktoken_ext/openai_public.py) and the sha1-of-URL names its cache uses.
R50K_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
_CACHE_NAMES = {
    "r50k_base": ("0ea1e91bbb3a60f729a8dc8f777fd2fc07cd8df4",),
    "gpt2": ("6d1cbeee0f20b3d9449abfede4726ed8212e3aee", "6c7ea1a7e38e3a7f062df639a5b80947f075ffe6"),
}
WHISPER_HINT = "pip install --no-deps openai-whisper==20250625 (run.sh and test.sh do this)"


class TokenizerError(RuntimeError):
    """The GPT-2 BPE could not be found or failed its hash check."""


def _tiktoken_cache_dir() -> Path:
    for var in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        if os.environ.get(var):
            return Path(os.environ[var])
    return Path(tempfile.gettempdir()) / "data-gym-cache"


def _cached_encoding_name() -> str | None:
    """The tiktoken encoding whose files already sit in tiktoken's cache, if any."""
    cache = _tiktoken_cache_dir()
    for name, files in _CACHE_NAMES.items():
        if all((cache / f).is_file() for f in files):
            return name
    return None


def whisper_bpe_path() -> Path | None:
    """Path of whisper's gpt2.tiktoken, located without importing whisper (None if not installed)."""
    spec = importlib.util.find_spec("whisper")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "assets" / "gpt2.tiktoken"
    return path if path.is_file() else None


def encoding_from_file(path: Path, expected_sha256: str = R50K_SHA256) -> tiktoken.Encoding:
    """A GPT-2 tiktoken.Encoding from a local r50k-format BPE file, after checking its sha256."""
    from tiktoken.load import load_tiktoken_bpe
    from tiktoken_ext.openai_public import r50k_pat_str

    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != expected_sha256:
        raise TokenizerError(
            f"{path}: sha256 {digest} does not match the GPT-2 pin {expected_sha256}; "
            f"the file is corrupt or not GPT-2's. Reinstall it: {WHISPER_HINT}")
    return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str,
                             mergeable_ranks=load_tiktoken_bpe(str(path)),
                             special_tokens={EOT_TOKEN: EOT_ID})


@functools.cache
def get_encoding() -> tiktoken.Encoding:
    """The GPT-2 encoding, from tiktoken's cache or the pinned whisper file (never the network)."""
    cached = _cached_encoding_name()
    if cached is not None:
        return tiktoken.get_encoding(cached)
    path = whisper_bpe_path()
    if path is None:
        raise TokenizerError(
            "GPT-2 BPE not found: tiktoken's cache "
            f"({_tiktoken_cache_dir()}) has no GPT-2 files and openai-whisper is not installed. "
            f"Fix: {WHISPER_HINT}")
    return encoding_from_file(path)


def encode_document(text: str) -> list[int]:
    """One document's ids with its BOS first: [50256, ...encode_ordinary(text)]."""
    return [EOT_ID, *get_encoding().encode_ordinary(text)]


def token_bytes(token_id: int) -> bytes:
    """The bytes of one GPT-2 token (for the prefix-token table)."""
    return get_encoding().decode_single_token_bytes(token_id)


def mergeable_ranks() -> dict[bytes, int]:
    """{token bytes: id} of the 50,256 ordinary GPT-2 tokens (no special tokens)."""
    enc = get_encoding()
    return {enc.decode_single_token_bytes(i): i for i in range(enc.n_vocab) if i != EOT_ID}
