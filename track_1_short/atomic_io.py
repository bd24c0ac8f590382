"""Atomic file writes shared by the run report (report.py), the profiler (perf/profiling.py) and
the benches (bench/step.py keeps profiler traces with copy_file_atomic): a reader never sees a
half-written file (temp file in the same folder + os.replace).
Torch-free; imports nothing of the package.
"""

import json
import os
import shutil
from pathlib import Path


def write_text_atomic(path: Path, text: str) -> None:
    """Write text to a temp file and rename it: readers never see a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json_atomic(path: Path, obj) -> None:
    """Write JSON through write_text_atomic."""
    write_text_atomic(path, json.dumps(obj, indent=1, default=str) + "\n")


def copy_file_atomic(src: Path, dst: Path) -> None:
    """Copy src to dst through a temp file and a rename: dst is whole or absent."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)
