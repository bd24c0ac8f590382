"""The GPU scripts' variants build valid runs: every variant that scripts/gpu/loss_variants.sh
(loss_ablations.sh and loss_parity.sh) and scripts/gpu/fp8_step.sh know, its flags taken from the
script's own `variant_flags`, parsed
with the small-gpu preset and the model built on the meta device. A flag that no longer exists or
a combination the config refuses fails here on the CPU instead of in a device call.

Hardware: CPU only, a few seconds. Run: `.venv/bin/python -m pytest tests/test_gpu_scripts.py -q`.
"""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import step as bench_step
from track_1_short import config
from track_1_short.model.gpt import GPT

GPU = Path(__file__).resolve().parents[1] / "scripts" / "gpu"
SCRIPTS = ("loss_variants.sh", "fp8_step.sh")


FUNCTION = {"loss_variants.sh": "loss_variant_flags", "fp8_step.sh": "variant_flags"}


def _variants(script: str) -> list[str]:
    """The case labels of the script's flags function."""
    text = (GPU / script).read_text()
    body = text[text.index(f"\n{FUNCTION[script]}() {{"):]
    body = body[: body.index("\n}\n")]
    return [v for v in re.findall(r"^\s+(\w+)\)", body, flags=re.M)]


def _source(script: str) -> str:
    """bash that defines the script's flags function alone (loss_variants.sh's too, which
    fp8_step.sh sources for its loss-variant step times)."""
    return " ".join(f"eval \"$(sed -n '/^{FUNCTION[s]}() {{/,/^}}/p' {shlex.quote(str(GPU / s))})\";"
                    for s in dict.fromkeys(("loss_variants.sh", script)))


def _flags(script: str, variant: str) -> list[str]:
    """The script's flags function on VARIANT, as bash prints it."""
    out = subprocess.run(["bash", "-c", f"{_source(script)} {FUNCTION[script]} {variant}"], check=True,
                         capture_output=True, text=True).stdout
    return out.split()


CASES = [(s, v) for s in SCRIPTS for v in _variants(s)]


def test_every_script_has_variants():
    assert {"base", "dense_ngram", "head_like", "head_mudd"} <= set(_variants("loss_variants.sh"))
    assert {"bf16", "fp8_mlp", "fast", "fast_head_mudd"} <= set(_variants("fp8_step.sh"))


@pytest.mark.parametrize("script, variant", CASES, ids=[f"{s}:{v}" for s, v in CASES])
def test_variant_parses_and_builds(script, variant, tmp_path):
    """Each variant's flags as the program the script passes them to reads them: the trainer
    (loss_variants.sh) or bench/step.py (fp8_step.sh), then the model built."""
    flags = _flags(script, variant)
    if script == "fp8_step.sh":
        args = bench_step.parse(["--stage", "C", "--data-dir", str(tmp_path), *flags,
                                 "--out", str(tmp_path / "o.json")])
        cfg = bench_step.base_config(args)
    else:
        cfg = config.parse(["--preset", "small-gpu", "--data-dir", str(tmp_path), *flags])
    with torch.device("meta"):
        GPT(cfg.model)


def test_the_record_profile_is_the_ablations_together(tmp_path):
    """--model-profile record (head_mudd) gives the config of its six feature ablations'
    flags together, so each of its fields has its ablation; --set still overrides it; a preset
    whose model it does not fit is refused naming the profile."""
    assert _flags("loss_variants.sh", "head_mudd") == ["--model-profile", "record"]
    parts = [f for v in ("uniform_o", "dense_wd", "no_trigram", "attn_in7", "mudd_dc", "mudd_conn")
             for f in _flags("loss_variants.sh", v)]
    common = ["--preset", "small-gpu", "--data-dir", str(tmp_path)]
    profile = config.parse([*common, "--model-profile", "record"])
    assert profile.to_dict() == config.parse([*common, *parts]).to_dict()
    assert profile.to_dict() != config.parse(common).to_dict()
    assert profile.model.mudd.dc and profile.model.attn_input_layer == 7
    over = config.parse([*common, "--model-profile", "record", "--set", "model.mudd.dc=false"])
    assert not over.model.mudd.dc and over.model.mudd.gates
    # bench/step.py's flag is the trainer's (fp8_step.sh passes head_mudd's flags to it)
    bench = bench_step.parse(["--model-profile", "record", "--out", str(tmp_path / "o.json")])
    assert bench_step.base_config(bench).model == profile.model


def test_the_record_profile_is_refused_where_the_model_does_not_fit(capsys):
    with pytest.raises(SystemExit) as e:
        config.parse(["--preset", "cpu-tiny", "--model-profile", "record"])
    assert e.value.code == 2
    assert "--model-profile record on preset cpu-tiny: GPTConfig.attn_input_layer=7" in capsys.readouterr().err
    # a --set can settle what the profile alone would not: validated once, after both
    cfg = config.parse(["--preset", "cpu-tiny", "--model-profile", "record",
                        "--set", "model.attn_input_layer=none"])
    assert cfg.model.attn_input_layer is None and cfg.model.mudd.gates
    # an error of the other flags is theirs, not the profile's
    with pytest.raises(SystemExit):
        config.parse(["--preset", "small-gpu", "--model-profile", "record", "--set", "optim.lr=x"])
    err = capsys.readouterr().err
    assert "--set optim.lr=x" in err and "--model-profile" not in err


def test_an_unknown_variant_is_refused():
    result = subprocess.run(
        ["bash", "-c", f"{_source('loss_variants.sh')} loss_variant_flags no_such_variant"],
        capture_output=True, text=True)
    assert result.returncode == 2 and "unknown variant 'no_such_variant'" in result.stderr


_FALLBACKS = (("einops", "einops", "einops-0.8.2"), ("cuda.bindings", "cuda/bindings", "cuda_bindings-13.0.3"),
              ("cuda.pathfinder", "cuda/pathfinder", "cuda_pathfinder-1.9.1"),
              ("google.protobuf", "google/protobuf", "protobuf-6.33.6"))


def _fake_fa4_carry(repo: Path, *, corrupt: bool = False, fallback: bool = True) -> None:
    """The two carry halves as scripts/gpu/fa4_wheels.sh writes them, around a tarball of
    stand-in packages: `cutlass` (through nvidia_cutlass_dsl/dsl_packages, as the real wheel
    lays it out), `flash_attn.cute.interface`, `quack.epilogue.library` (it records whether its
    file lies under a site-packages folder, the test quack's function fingerprint makes), and,
    with `fallback` (FA4_FALLBACK=1), the four fallbacks."""
    import hashlib
    import io
    import tarfile

    files = {
        "fa4/site/nvidia_cutlass_dsl/dsl_packages/cutlass/__init__.py": "",
        "fa4/site/flash_attn/__init__.py": "",
        "fa4/site/flash_attn/cute/__init__.py": "",
        "fa4/site/flash_attn/cute/interface.py": "",
        "fa4/site/quack/__init__.py": "",
        "fa4/site/quack/epilogue/__init__.py": "",
        "fa4/site/quack/epilogue/library.py": (
            "import os\n"
            "def f():\n    pass\n"
            "assert f'{os.sep}site-packages{os.sep}' in f.__code__.co_filename, f.__code__.co_filename\n"),
    }
    for _, path, dist in _FALLBACKS if fallback else ():
        files[f"fa4/fallback/{path}/__init__.py"] = ""
        files[f"fa4/fallback/{dist}.dist-info/METADATA"] = ""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    blob = buf.getvalue()
    a, b = repo / ".carry" / "fa4a", repo / ".carry" / "fa4b"
    a.mkdir(parents=True)
    b.mkdir(parents=True)
    digest = hashlib.sha256(blob if not corrupt else blob + b"x").hexdigest()
    (a / "SHA256SUMS").write_text(f"{digest}  fa4.tar.xz\n")
    (a / "PINS").write_text("flash-attn-4==stand-in\n")
    (a / "fa4.tar.xz.part0").write_bytes(blob[: len(blob) // 2])
    (b / "fa4.tar.xz.part1").write_bytes(blob[len(blob) // 2:])


def _fa4_install(repo: Path) -> subprocess.CompletedProcess:
    # python3 is this interpreter (the device hosts' has tarfile's extraction filters too)
    path = f"{Path(sys.executable).parent}:/usr/bin:/bin"
    return subprocess.run(["bash", str(GPU / "fa4_install.sh")], cwd=repo, capture_output=True,
                          text=True, env={"PATH": path, "HOME": str(repo)})


def test_fa4_install_puts_the_packages_under_a_site_packages_folder(tmp_path):
    """quack keys an epilogue's installed-library callees by name only where their files lie
    under site-packages; elsewhere its fingerprint fails on cutlass internals (the H200 run of
    2026-12-01). The stand-in quack asserts that at import, as the real one fails there."""
    _fake_fa4_carry(tmp_path)
    result = _fa4_install(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "quack epilogues from" in result.stdout and "do not import" not in result.stderr
    env = (tmp_path / ".fa4_site" / "ENV").read_text()
    paths = env.split("PYTHONPATH=", 1)[1].split(":")[:2]
    assert all("/.fa4_site/site-packages" in p for p in paths), env
    assert (tmp_path / ".fa4_site" / "site-packages" / "nvidia_cutlass_dsl" / "dsl_packages" / "cutlass").is_dir()


def test_fa4_install_without_fallbacks_needs_them_on_the_host(tmp_path):
    """A tarball built without FA4_FALLBACK=1 installs where this Python has the four packages
    (the device image does) and otherwise is exit 2 naming the first one missing, with no
    half-made .fa4_site left behind."""
    import importlib.util

    def present(module: str) -> bool:
        try:
            return importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # the parent namespace package is absent
            return False

    missing = [module for module, _, _ in _FALLBACKS if not present(module)]
    _fake_fa4_carry(tmp_path, fallback=False)
    result = _fa4_install(tmp_path)
    if not missing:
        assert result.returncode == 0, result.stdout + result.stderr
        assert "fallbacks added: none" in result.stdout
        return
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"this Python lacks {missing[0]} and the tarball has no fallback" in result.stderr
    assert "FA4_FALLBACK=1" in result.stderr
    assert not (tmp_path / ".fa4_site").exists()


def test_fa4_install_refuses_a_missing_or_mismatched_half(tmp_path):
    result = _fa4_install(tmp_path)
    assert result.returncode == 2 and ".carry/fa4a missing" in result.stderr
    _fake_fa4_carry(tmp_path, corrupt=True)
    result = _fa4_install(tmp_path)
    assert result.returncode == 2 and "does not match .carry/fa4a/SHA256SUMS" in result.stderr


def test_fa4_wheels_recut_sizes_the_first_part_to_the_tracked_files(tmp_path):
    """FA4_RECUT=1 joins the two parts, checks them against SHA256SUMS and cuts them again so the
    first call (tracked files + .carry/fa4a + .carry/tiktoken, by the blocks they take on disk)
    stays at 62.5 MiB; parts that do not match their SHA256SUMS are exit 2, and the old parts
    stay."""
    import hashlib

    (tmp_path / "scripts" / "gpu").mkdir(parents=True)
    (tmp_path / "scripts" / "gpu" / "fa4_wheels.sh").write_text((GPU / "fa4_wheels.sh").read_text())
    (tmp_path / ".gitignore").write_text(".carry/\n")
    tiktoken = tmp_path / ".carry" / "tiktoken"
    tiktoken.mkdir(parents=True)
    (tiktoken / "gpt2").write_bytes(b"t" * 1000)
    _fake_fa4_carry(tmp_path)
    # a stand-in tarball larger than a disk block, so the cut lands inside it
    blob = bytes(range(256)) * 64  # 16 KiB
    (tmp_path / ".carry/fa4a/fa4.tar.xz.part0").write_bytes(blob[:1000])
    (tmp_path / ".carry/fa4b/fa4.tar.xz.part1").write_bytes(blob[1000:])
    (tmp_path / ".carry/fa4a/SHA256SUMS").write_text(f"{hashlib.sha256(blob).hexdigest()}  fa4.tar.xz\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)

    def allocated(path):  # what `du -B1` counts: the blocks the disk holds
        return path.stat().st_blocks * 512
    budget = 62 * 2**20 + 2**19 - allocated(tiktoken / "gpt2")
    others = sum(allocated(tmp_path / p) for p in (".gitignore", "scripts/gpu/fa4_wheels.sh"))
    # tracked files written (not sparse: the script counts blocks, as the device tool's limit
    # does) to leave 8 KiB of the first call's 62.5 MiB for the first part
    (tmp_path / "big.bin").write_bytes(b"b" * (budget - others - 8192))
    subprocess.run([*git, "add", "-A"], cwd=tmp_path, check=True)
    tracked = sum(allocated(tmp_path / p) for p in (".gitignore", "big.bin", "scripts/gpu/fa4_wheels.sh"))
    expected_part0 = budget - tracked
    assert 0 < expected_part0 < len(blob)

    def recut():
        return subprocess.run(["bash", "scripts/gpu/fa4_wheels.sh"], cwd=tmp_path, capture_output=True,
                              text=True, env={"PATH": "/usr/bin:/bin", "FA4_RECUT": "1"})

    result = recut()
    assert result.returncode == 0, result.stdout + result.stderr
    part0 = (tmp_path / ".carry/fa4a/fa4.tar.xz.part0").read_bytes()
    part1 = (tmp_path / ".carry/fa4b/fa4.tar.xz.part1").read_bytes()
    assert len(part0) == expected_part0 and part0 + part1 == blob
    assert hashlib.sha256(blob).hexdigest() in (tmp_path / ".carry/fa4a/SHA256SUMS").read_text()
    assert (tmp_path / ".carry/fa4a/PINS").read_text() == "flash-attn-4==stand-in\n"
    (tmp_path / ".carry/fa4b/fa4.tar.xz.part1").write_bytes(part1 + b"x")
    result = recut()
    assert result.returncode == 2 and "do not match .carry/fa4a/SHA256SUMS" in result.stderr
    assert (tmp_path / ".carry/fa4a/fa4.tar.xz.part0").read_bytes() == part0


def test_choose_then_vs_record_settings_parse(tmp_path):
    """scripts/gpu/choose_then_vs_record.sh's fast set, with the candidate the next lease tries
    (train.qk_norm_rope=triton), as bench/step.py reads them; and its compare mode's choice from the
    first call's JSONs: a candidate 0.3% faster wins, a slower or a missing one does not."""
    text = (GPU / "choose_then_vs_record.sh").read_text()
    fast = subprocess.run(  # the script's HEAD and FAST lines, as bash expands them
        ["bash", "-c", f"eval \"$(grep -E '^(HEAD|FAST)=' {shlex.quote(str(GPU / 'choose_then_vs_record.sh'))})\"; echo $FAST"],
        check=True, capture_output=True, text=True).stdout.split()
    flags = [f for item in [*fast, "train.qk_norm_rope=triton"] for f in ("--set", item)]
    args = bench_step.parse(["--stage", "C", "--data-dir", str(tmp_path), *flags,
                             "--out", str(tmp_path / "o.json")])
    cfg = bench_step.base_config(args)
    assert cfg.train.qk_norm_rope == "triton" and cfg.model.attention_backend == "fa4"
    choice = re.search(r"<<'PY'\n(.*?)\nPY\n", text, flags=re.S).group(1)
    (tmp_path / "build" / "choose").mkdir(parents=True)

    def decide(base_ms, cand_ms, warmups=(70, 80)):
        for name, ms, w in (("base", base_ms, warmups[0]), ("candidate", cand_ms, warmups[1])):
            if ms is not None:
                (tmp_path / "build" / "choose" / f"c_{name}.json").write_text(json.dumps(
                    {"variants": {"on": {"step_ms": {"median_ms": ms}, "warmup_s": w}}}))
        out = subprocess.run([sys.executable, "-c", choice], cwd=tmp_path, capture_output=True,
                             text=True, env={"MIN_GAIN": "0.003"})
        return out.stdout.split()[0]

    assert decide(600.0, 597.0) == "yes"
    assert decide(600.0, 599.0) == "no"  # 0.17%: inside the noise
    assert decide(600.0, 590.0, warmups=(70, 200)) == "no"  # 130 s more warmup
    (tmp_path / "build" / "choose" / "c_candidate.json").unlink()
    assert decide(600.0, None) == "no"


@pytest.mark.parametrize("items, installs", [
    ("model.attention_backend=fa4 train.mlp_kernel=quack", True),
    ("train.mlp_kernel=quack", True),
    ("train.ngram_rows_in_step=false", False),
    ("", False),
])
def test_the_fa4_packages_come_only_with_settings_that_import_them(items, installs):
    """common.sh's use_fa4_packages_for (vs_record.sh and host_bound.sh): the two-call fa4
    install runs where OURS_SET names fa4 or quack, and only there (a call without .carry/fa4b
    must not fail on it)."""
    script = (f"source <(sed -n '/^use_fa4_packages_for() {{/,/^}}/p' {shlex.quote(str(GPU / 'common.sh'))}); "
              f"use_fa4_packages() {{ echo installed; }}; use_fa4_packages_for {shlex.quote(items)}")
    out = subprocess.run(["bash", "-c", script], check=True, capture_output=True, text=True).stdout
    assert (out.strip() == "installed") is installs, out
    for name in ("vs_record.sh", "host_bound.sh"):
        assert 'use_fa4_packages_for "${OURS_SET:-}"' in (GPU / name).read_text(), name


def _pack(out: Path) -> None:
    """common.sh's pack_outputs on OUT (its definition and RETURN_FILES alone, as a device call
    runs it)."""
    script = (f"source <(sed -n '/^RETURN_FILES=/p;/^pack_outputs() {{/,/^}}/p' {shlex.quote(str(GPU / 'common.sh'))}); "
              f"OUT={shlex.quote(str(out))} pack_outputs anchor")
    subprocess.run(["bash", "-c", script], check=True, capture_output=True, text=True)


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def test_pack_outputs_leaves_at_most_what_the_device_tool_returns(tmp_path):
    """Logs, runs and named folders go into results.tgz; where more than 8 files would be left
    (the device tool returns 8), the rest go into outputs.tgz, none lost; a few stay as they are."""
    import tarfile

    few, many = tmp_path / "few", tmp_path / "many"
    for out, loose in ((few, 3), (many, 9)):
        for sub in ("logs", "runs/r1", "anchor"):
            (out / sub).mkdir(parents=True)
            (out / sub / "x.log").write_text(sub)
        for i in range(loose):
            (out / ("traces" if i == 0 else ".") / f"f{i}.json").parent.mkdir(exist_ok=True)
            (out / ("traces" if i == 0 else ".") / f"f{i}.json").write_text(str(i))
        _pack(out)
    assert _files(few) == {"results.tgz", "traces/f0.json", "f1.json", "f2.json"}
    assert _files(many) == {"results.tgz", "outputs.tgz"}
    with tarfile.open(many / "outputs.tgz") as t:
        assert sorted(t.getnames()) == sorted(["traces/f0.json", *(f"f{i}.json" for i in range(1, 9))])
    with tarfile.open(many / "results.tgz") as t:
        assert {"logs/x.log", "runs/r1/x.log", "anchor/x.log"} <= set(t.getnames())
