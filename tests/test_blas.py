"""train.blas (perf/blas.py, perf/blas_config.py): the setting's environment and library are in
force inside `applied` and restored after it; every case where it could not take effect is
refused (no CUDA device, CUDA already initialised, another setting applied before in a process
that used CUDA, a workspace variable already set otherwise); the config refuses unknown names and
the pairing with --deterministic; the trainer and bench/step.py exit 2 with the message on a CPU
machine, before anything is written. CUDA itself is faked (torch.cuda.is_available /
is_initialized, preferred_blas_library), so no cuBLAS runs: whether a setting drops the memsets is
bench/gemm_memsets.py's measurement on the H200.
Hardware: CPU, ~5 s. Run: `.venv/bin/python -m pytest tests/test_blas.py -q`.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from track_1_short import config as config_mod
from track_1_short.perf import blas
from track_1_short.perf.blas_config import BLAS_SETTINGS, WORKSPACE_ENV
from track_1_short.trainer.lifecycle import train

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA device that is available and not initialised; records preferred_blas_library calls."""
    state = {"initialized": False, "library": "cublas", "calls": []}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: state["initialized"])

    def preferred(backend=None):
        if backend is not None:
            state["calls"].append(backend)
            state["library"] = backend
        return state["library"]

    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", preferred)
    monkeypatch.setattr(blas, "_process_setting", None)
    for k in WORKSPACE_ENV:
        monkeypatch.delenv(k, raising=False)
    return state


@pytest.mark.parametrize("name", [n for n in BLAS_SETTINGS if n != "default"])
def test_each_setting_is_in_force_inside_and_restored_after(fake_cuda, name):
    setting = BLAS_SETTINGS[name]
    with blas.applied(name):
        for k in WORKSPACE_ENV:
            assert os.environ.get(k) == setting.env.get(k)
        assert fake_cuda["library"] == (setting.library or "cublas")
    assert not any(k in os.environ for k in WORKSPACE_ENV)
    assert fake_cuda["library"] == "cublas"
    assert blas._process_setting is None  # CUDA never initialised: nothing for cuBLAS to keep


def test_a_process_that_used_cuda_keeps_its_setting(fake_cuda):
    with blas.applied("no_workspace"):
        fake_cuda["initialized"] = True  # the block's run made cuBLAS handles
    with blas.applied("no_workspace"):  # the same setting again: fine
        pass
    for other in ("cublaslt", "default"):
        with pytest.raises(blas.BlasSettingError, match=f"train.blas=.*{other}.*after 'no_workspace'.*fresh process"):
            with blas.applied(other):
                pass


def test_refusals_name_the_setting_and_the_fix(fake_cuda, monkeypatch):
    fake_cuda["initialized"] = True
    with pytest.raises(blas.BlasSettingError, match="'no_workspace': CUDA is already initialised.*before the first CUDA call"):
        with blas.applied("no_workspace"):
            pass
    fake_cuda["initialized"] = False
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    with pytest.raises(blas.BlasSettingError, match=r"sets \['CUBLAS_WORKSPACE_CONFIG'\], already set.*:4096:8"):
        with blas.applied("no_cublas_workspace"):
            pass
    with blas.applied("no_lt_workspace"):  # sets only the other variable: no clash
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    with pytest.raises(blas.BlasSettingError, match="train.blas='fast': one of"):
        with blas.applied("fast"):
            pass
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(blas.BlasSettingError, match="no CUDA device: use train.blas=default"):
        with blas.applied("cublaslt"):
            pass
    with blas.applied("default"):  # torch's own needs nothing
        pass


@pytest.mark.parametrize("argv, needle", [
    (["--set", "train.blas=fast"], "train.blas='fast': one of"),
    (["--deterministic", "--set", "train.blas=no_workspace"],
     "with --deterministic: deterministic mode needs cuBLAS's workspace"),
])
def test_config_refuses_unknown_names_and_deterministic_mode(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        config_mod.parse(["--preset", "cpu-tiny", *argv])
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_trainer_on_a_cpu_machine_exits_2_before_writing(tmp_path, capsys):
    cfg = config_mod.parse(["--preset", "cpu-tiny", "--set", "train.blas=no_workspace",
                            "--runs-dir", str(tmp_path)])
    assert train(cfg) == 2
    err = capsys.readouterr().err
    assert "train.blas='no_workspace' is a cuBLAS setting and this machine has no CUDA device" in err
    assert "Traceback" not in err and not list(tmp_path.iterdir())
    assert not any(k in os.environ for k in WORKSPACE_ENV)


def test_step_bench_on_a_cpu_machine_exits_2(tmp_path):
    out = tmp_path / "step.json"
    proc = subprocess.run([sys.executable, "bench/step.py", "--smoke", "--stage", "A", "--out", str(out),
                           "--set", "train.blas=cublaslt"], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "train.blas='cublaslt' is a cuBLAS setting" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()
