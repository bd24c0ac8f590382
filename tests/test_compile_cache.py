"""The portable compile cache (perf/compile_cache.py): a second process on an empty local inductor
cache loads the file and hits the FX-graph and AOTAutograd caches instead of compiling; a damaged
file is an error naming it. CPU inductor in subprocesses (each its own TORCHINDUCTOR_CACHE_DIR),
~30 s on 2 cores. Run: `.venv/bin/python -m pytest tests/test_compile_cache.py -q`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from track_1_short.perf import compile_cache
from track_1_short.perf.compile_cache import CompileCacheError

REPO = Path(__file__).resolve().parents[1]


def _probe(cache_file: Path, inductor_dir: Path) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(inductor_dir), PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, str(REPO / "tests" / "compile_cache_probe.py"), str(cache_file)],
                         env=env, capture_output=True, text=True, check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_second_process_hits_the_cache(tmp_path):
    cache = tmp_path / "compile_cache.bin"
    first = _probe(cache, tmp_path / "inductor_a")
    assert not first["load"]["loaded"] and first["fx_miss"] > 0 and first["fx_hit"] == 0
    assert first["save"]["saved"] and cache.stat().st_size == first["save"]["bytes"]
    second = _probe(cache, tmp_path / "inductor_b")  # a fresh local cache: only the file helps
    assert second["load"]["loaded"] and second["load"]["artifacts"].get("inductor", 0) > 0
    assert second["fx_miss"] == 0 and second["fx_hit"] == first["fx_miss"]
    assert second["aot_hit"] >= 1
    assert not list(tmp_path.glob("*.tmp")), "the save left a temp file"


def test_damaged_file_names_itself(tmp_path):
    bad = tmp_path / "cache.bin"
    bad.write_bytes(b"not a cache")
    with pytest.raises(CompileCacheError, match=str(bad)):
        compile_cache.load(bad)


def test_missing_file_loads_nothing(tmp_path):
    info = compile_cache.load(tmp_path / "absent.bin")
    assert info["loaded"] is False


def test_flag_needs_compile():
    from track_1_short import config as config_mod

    with pytest.raises(SystemExit):
        config_mod.parse(["--preset", "cpu-tiny", "--compile-cache", "x.bin"])  # cpu-tiny: no compile
