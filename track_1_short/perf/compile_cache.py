"""Portable compile cache and compile counting for the trainer.

What it is for: the full model compiles once per step-graph key and once per validation window,
about a minute each on the H200 host (forward + backward, FlexAttention templates per window), which
is most of a short run's wall time. Inductor already keeps an on-disk cache, but a fresh machine
starts with an empty one. `torch.compiler.save_cache_artifacts()` serialises every artifact the
process produced (AOTAutograd and FX-graph cache entries with their Triton binaries) into one byte
string; `load_cache_artifacts()` puts them back into the local caches, so the next process on any
machine with the same torch/Triton/GPU hits the cache instead of compiling. Dynamo still traces
each frame (its guards are not cached), so a warm start still costs seconds per key.

Contract: `load(path)` before the first compile (missing file: nothing loaded, said in the log);
`save(path)` after the last compile, written to a temp file and renamed. A file that torch cannot
read is an error naming it, never silently ignored.

`graphs_compiled()`: dynamo's count of compiled graphs in this process, read before and after a
phase to show that the timed run compiled nothing (every recompile is a stall of seconds).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch


class CompileCacheError(RuntimeError):
    pass


def load(path: Path) -> dict:
    """Load the artifacts in `path` into the local compile caches; returns what was loaded."""
    if not path.is_file():
        return {"path": str(path), "loaded": False, "reason": "no such file yet (written at the end)"}
    data = path.read_bytes()
    try:
        info = torch.compiler.load_cache_artifacts(data)
    except Exception as e:  # torch raises several types for a foreign or truncated file
        info, error = None, f"{type(e).__name__}: {e}"
    else:
        error = "load_cache_artifacts returned None (it logs the reason as a warning)"
    if info is None:  # torch only warns on a corrupt file: this is the error it should be
        raise CompileCacheError(f"--compile-cache {path}: torch could not load it ({error}); it "
                                f"was written by another torch/Triton version or is damaged: delete "
                                f"it or pass another path")
    return {"path": str(path), "loaded": True, "bytes": len(data), "artifacts": _counts(info)}


def save(path: Path) -> dict:
    """Write every artifact this process compiled or loaded to `path` (atomic)."""
    result = torch.compiler.save_cache_artifacts()
    if result is None:
        return {"path": str(path), "saved": False, "reason": "nothing was compiled"}
    data, info = result
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return {"path": str(path), "saved": True, "bytes": len(data), "artifacts": _counts(info)}


def _counts(info) -> dict[str, int]:
    """CacheInfo -> {artifact kind: count} (JSON-friendly)."""
    if info is None:
        return {}
    artifacts = getattr(info, "artifacts", {}) or {}
    return {str(kind): len(keys) for kind, keys in artifacts.items()}


def graphs_compiled() -> int:
    """Graphs dynamo compiled so far in this process (first compiles and recompiles alike)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
