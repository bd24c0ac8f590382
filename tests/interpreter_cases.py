"""Runs a Triton kernel's cases file in the Triton interpreter, in a child pytest process.

Why a child: TRITON_INTERPRET=1 must be set before triton is first imported, and must not leak
into the other tests of this process (they run the kernels' CPU paths without the interpreter).
Used by tests/test_softcap_ce.py, tests/test_ngram_adam.py and tests/test_fp8_quantise.py, each
for its own `*_cases.py` file (not collected by the normal suite: the name does not match
test_*.py). Not a test module itself.
"""

import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_interpreter_cases(cases_file: str, num_cases: int, timeout_s: int = 600,
                          show_output: bool = False, select: Sequence[str] = ()) -> None:
    """Run tests/<cases_file> under TRITON_INTERPRET=1 (one intra-op thread) and assert that it
    passes with exactly `num_cases` tests (a case that silently stopped being collected fails
    here). show_output: pytest -s, so the cases' printed errors reach the log. select: run only
    these tests of the file, each a node id's tail (`test_name` or `test_name[param-id]`); a name
    that matches no test fails the child (pytest: "not found")."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    targets = [f"tests/{cases_file}::{name}" for name in select] or [f"tests/{cases_file}"]
    cmd = [sys.executable, "-m", "pytest", "-q", *(["-s"] if show_output else []), "-p",
           "no:cacheprovider", *targets]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    out = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, out
    assert re.search(rf"\b{num_cases} passed\b", proc.stdout), out
