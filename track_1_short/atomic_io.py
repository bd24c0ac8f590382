"""Atomic file writes shared by the run report (report.py), the profiler (perf/profiling.py) and
the benches: a reader never sees a half-written file (temp file in the same folder + os.replace).
Torch-free; imports nothing of the package.
"""

import json
import os
from pathlib import Path


def write_json_atomic(path: Path, obj) -> None:
    """Write JSON to a temp file and rename it: readers never see a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1, default=str) + "\n")
    os.replace(tmp, path)
