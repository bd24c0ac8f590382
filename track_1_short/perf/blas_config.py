"""The process's cuBLAS settings by name: TrainConfig.blas (--set train.blas=NAME). The names and
what each sets live here (torch-free, a config module); perf/blas.py applies one to the process.

Settings (BLAS_SETTINGS): "default" (torch's own: nothing set); "no_cublas_workspace"
(CUBLAS_WORKSPACE_CONFIG=:0:0); "no_lt_workspace" (CUBLASLT_WORKSPACE_SIZE=0); "no_workspace"
(both); "cublaslt" (torch.backends.cuda.preferred_blas_library("cublaslt"): matmuls through
cuBLASLt's heuristics); "cublaslt_no_workspace" (cublaslt with both workspaces 0). Why they
exist: perf/blas.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

WORKSPACE_ENV = ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE")


@dataclass(frozen=True, slots=True)
class BlasSetting:
    env: dict[str, str] = field(default_factory=dict)  # set before the first cuBLAS handle
    library: str | None = None  # torch.backends.cuda.preferred_blas_library, None: torch's


_NO_WS = {"CUBLAS_WORKSPACE_CONFIG": ":0:0", "CUBLASLT_WORKSPACE_SIZE": "0"}
BLAS_SETTINGS = {
    "default": BlasSetting(),
    "no_cublas_workspace": BlasSetting({"CUBLAS_WORKSPACE_CONFIG": ":0:0"}),
    "no_lt_workspace": BlasSetting({"CUBLASLT_WORKSPACE_SIZE": "0"}),
    "no_workspace": BlasSetting(dict(_NO_WS)),
    "cublaslt": BlasSetting(library="cublaslt"),
    "cublaslt_no_workspace": BlasSetting(dict(_NO_WS), library="cublaslt"),
}


def describe(name: str) -> str:
    """One log line: the setting's name and what it sets."""
    s = BLAS_SETTINGS[name]
    parts = [f"{k}={v}" for k, v in s.env.items()] + ([f"preferred_blas_library={s.library}"]
                                                      if s.library else [])
    return f"cuBLAS setting {name}" + (f" ({', '.join(parts)})" if parts else " (torch's own)")
