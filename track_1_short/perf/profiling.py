"""Profiling: the trainer's --profile-steps (`StepProfiler`) and the kernel statistics that it and
the benches report about GPU time (one definition for both).

`StepProfiler(start, end, out_dir, cuda)`: torch.profiler (CPU + CUDA activity) over timed steps
[start, end); the trainer calls `before(step)` / `after(step)` around each timed step. At `end - 1`
it writes `trace_steps_<start>_<end>.json.gz` (chrome trace, for chrome://tracing or Perfetto) and
`profile.json` (`kernel_stats` per step, top 30 kernels) into out_dir and returns the stats.

`trace_events(prof)` reads a finished torch.profiler.profile's chrome-trace events;
`kernel_stats(events, num_steps, top)` summarises them per step:
    kernel_ms          summed kernel durations / num_steps
    device_busy_ms     union of kernel, memcpy and memset intervals (overlaps, e.g. side streams,
                       counted once) / num_steps
    device_span_ms     first device start to last device end in the window / num_steps
    busy_fraction      device_busy_ms / device_span_ms (None without device events): how much of
                       the device's timeline inside the window was busy. The window's device work
                       need not be num_steps steps of it: the host runs ahead, so the queue holds
                       work of the step before the window when it opens, and the window's kernels
                       can exceed num_steps steps' worth; a ratio over the window's own span is
                       <= 1 either way (busy over a step time measured elsewhere was not: 1.025 at
                       stage C, docs/results/host_bound_h200_2026-12-01b.json)
    kernels_per_step   kernel launches / num_steps
    top_kernels        (top > 0) the `top` kernel names by total time: [{name, ms_per_step,
                       calls_per_step}], names cut at 200 characters before grouping
Times in the trace are microseconds. Nothing here touches the GPU.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from track_1_short.atomic_io import write_json_atomic

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def _read_trace(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f).get("traceEvents", [])


def trace_events(prof, keep: Path | None = None) -> list[dict]:
    """Chrome-trace events of a finished profiler (a trace can be exported once). `keep`: write
    the trace there, complete or not at all (temp name + rename; a .gz path is compressed)."""
    if keep is None:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(path))
            return _read_trace(path)
    keep.parent.mkdir(parents=True, exist_ok=True)
    tmp = keep.with_name(f"tmp{os.getpid()}.{keep.name}")  # same suffixes: torch gzips a .gz path
    prof.export_chrome_trace(str(tmp))
    os.replace(tmp, keep)
    return _read_trace(keep)


def top_kernels(events: list[dict], num_steps: int, top: int) -> list[dict]:
    """The `top` kernel names by total duration, largest first (see the module docstring)."""
    by_name: dict[str, list[float]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "kernel":
            by_name.setdefault(e.get("name", "?")[:200], []).append(e["dur"])
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return [{"name": name, "ms_per_step": sum(d) / 1e3 / num_steps,
             "calls_per_step": len(d) / num_steps} for name, d in ranked]


def kernel_stats(events: list[dict], num_steps: int, top: int = 0) -> dict:
    """Per-step kernel time, device-busy time (interval union) and span, the busy fraction, launches,
    and the top kernels (module docstring)."""
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in events
               if e.get("ph") == "X" and e.get("cat") == "kernel"]
    busy = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                  if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES)
    union, end = 0.0, float("-inf")
    for a, b in busy:
        if b > end:
            union += b - max(a, end)
            end = b
    span = (max(b for _, b in busy) - busy[0][0]) if busy else 0.0
    out = {"kernel_ms": sum(b - a for a, b in kernels) / 1e3 / num_steps,
           "device_busy_ms": union / 1e3 / num_steps,
           "device_span_ms": span / 1e3 / num_steps,
           "busy_fraction": union / span if span > 0 else None,
           "kernels_per_step": len(kernels) / num_steps}
    if top > 0:
        out["top_kernels"] = top_kernels(events, num_steps, top)
    return out


@dataclass(slots=True)
class StepProfiler:
    """torch.profiler over the timed steps [start, end) (module docstring)."""

    start: int
    end: int
    out_dir: Path
    cuda: bool
    top: int = 30
    _prof: object = None

    def before(self, step: int) -> None:
        if step == self.start:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=acts)
            self._prof.__enter__()

    def after(self, step: int) -> dict | None:
        """At the window's last step: stop, write the trace and profile.json, return the stats."""
        if self._prof is None or step != self.end - 1:
            return None
        if self.cuda:
            torch.cuda.synchronize()
        self._prof.__exit__(None, None, None)
        trace = self.out_dir / f"trace_steps_{self.start}_{self.end}.json.gz"
        stats = {"steps": [self.start, self.end], "trace": trace.name,
                 **kernel_stats(trace_events(self._prof, keep=trace), self.end - self.start, self.top)}
        write_json_atomic(self.out_dir / "profile.json", stats)
        self._prof = None
        return stats
