"""The process's cuBLAS setting applied: TrainConfig.blas (--set train.blas=NAME, the names in
perf/blas_config.py), for the trainer, bench/step.py and bench/gemm_memsets.py (which measures
every one of them).

Why: in the graphs-on step at stage A with one micro-step, each of cuBLAS's non-split-K nvjet
GEMMs (coopA / coopB kernels) is captured with a 4-byte memset right before it, 120 per step, and
the graph leaves ~4-6 us of idle device around each where two kernels elsewhere sit ~1 us apart
(lease 18's trace, docs/results/vs_record_h200_2026-12-03_lease18/call5/trace_A_on.json.gz): ~0.5 ms
per step, ~2% of the step's busy fraction. The memset zeroes a counter in cuBLAS's workspace; a
setting without one may make cuBLAS pick kernels that need none, perhaps slower ones. Which
setting drops the memsets at what GEMM cost is bench/gemm_memsets.py's question; the default
stays "default" until its answer (and a step measured with it) is committed.

Contract: `applied(name)` is a context manager entered before the process's first CUDA call.
torch reads both variables once per process, when it first makes a cuBLAS handle's workspace, so
a setting other than "default" without a CUDA device, or with CUDA already initialised, is
refused (BlasSettingError, a ValueError naming the setting and the fix), never half in effect;
so is a second, different setting in one process, and a workspace variable already set to
another value in the environment.
On exit the environment and the preferred library are restored (runs in one process, the tests,
do not leak it); where the block initialised CUDA, the process remembers the setting, and refuses
another one (or "default") later.
"""

from __future__ import annotations

import contextlib
import os

import torch

from track_1_short.perf.blas_config import BLAS_SETTINGS, WORKSPACE_ENV, describe

__all__ = ["BLAS_SETTINGS", "WORKSPACE_ENV", "BlasSettingError", "applied", "describe"]  # one import for callers


class BlasSettingError(ValueError):
    """A cuBLAS setting that cannot take effect in this process; the message names it and the fix."""


_process_setting: str | None = None  # the non-default setting a CUDA-using block applied


def _refusal(name: str, flag: str) -> str | None:
    """Why setting `name` cannot take effect in this process now (module docstring), or None."""
    setting = BLAS_SETTINGS[name]
    if name == "default":
        return (None if _process_setting is None else
                f"{flag}=default after {_process_setting!r} in this process: cuBLAS keeps the first "
                f"workspace setting; run it in a fresh process")
    if not torch.cuda.is_available():
        return f"{flag}={name!r} is a cuBLAS setting and this machine has no CUDA device: use {flag}=default"
    if _process_setting not in (None, name):
        return (f"{flag}={name!r} after {_process_setting!r} in this process: cuBLAS keeps the first "
                f"workspace setting; run it in a fresh process")
    if _process_setting is None and torch.cuda.is_initialized():
        return (f"{flag}={name!r}: CUDA is already initialised in this process, so cuBLAS may have "
                f"read its workspace setting; apply it before the first CUDA call")
    clash = {k: os.environ[k] for k in WORKSPACE_ENV
             if k in setting.env and os.environ.get(k, setting.env[k]) != setting.env[k]}
    if clash:
        return (f"{flag}={name!r} sets {sorted(clash)}, already set in the environment to {clash}: "
                f"unset them or use {flag}=default")
    return None


@contextlib.contextmanager
def applied(name: str, flag: str = "train.blas"):
    """The setting `name` in force inside the block (module docstring: before any CUDA call);
    BlasSettingError where it cannot be."""
    global _process_setting
    if name not in BLAS_SETTINGS:
        raise BlasSettingError(f"{flag}={name!r}: one of {tuple(BLAS_SETTINGS)}")
    refusal = _refusal(name, flag)
    if refusal is not None:
        raise BlasSettingError(refusal)
    setting = BLAS_SETTINGS[name]
    before = {k: os.environ.get(k) for k in setting.env}
    library = torch.backends.cuda.preferred_blas_library() if setting.library else None
    os.environ.update(setting.env)
    if setting.library:
        torch.backends.cuda.preferred_blas_library(setting.library)
    try:
        yield setting
    finally:
        if name != "default" and torch.cuda.is_initialized():  # cuBLAS may have read it: kept
            _process_setting = name
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if library is not None:
            torch.backends.cuda.preferred_blas_library(library)
