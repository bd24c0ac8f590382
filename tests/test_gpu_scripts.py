"""The GPU scripts' variants build valid runs: every variant that scripts/gpu/loss_ablations.sh
and scripts/gpu/fp8_step.sh know, its flags taken from the script's own `variant_flags`, parsed
with the small-gpu preset and the model built on the meta device. A flag that no longer exists or
a combination the config refuses fails here on the CPU instead of in a device call.

Hardware: CPU only, a few seconds. Run: `.venv/bin/python -m pytest tests/test_gpu_scripts.py -q`.
"""

import re
import shlex
import subprocess
from pathlib import Path

import pytest
import torch

from track_1_short import config
from track_1_short.model.gpt import GPT

GPU = Path(__file__).resolve().parents[1] / "scripts" / "gpu"
SCRIPTS = ("loss_ablations.sh", "fp8_step.sh")


def _variants(script: str) -> list[str]:
    """The case labels of the script's variant_flags function."""
    text = (GPU / script).read_text()
    body = text[text.index("variant_flags() {"):]
    body = body[: body.index("\n}\n")]
    return [v for v in re.findall(r"^\s+(\w+)\)", body, flags=re.M)]


def _flags(script: str, variant: str) -> list[str]:
    """variant_flags VARIANT as the script's bash prints it (the function alone is sourced)."""
    src = f"eval \"$(sed -n '/^variant_flags() {{/,/^}}/p' {shlex.quote(str(GPU / script))})\"; "
    out = subprocess.run(["bash", "-c", src + f"variant_flags {variant}"], check=True,
                         capture_output=True, text=True).stdout
    return out.split()


CASES = [(s, v) for s in SCRIPTS for v in _variants(s)]


def test_every_script_has_variants():
    assert {"base", "dense_ngram", "head_like", "head_mudd"} <= set(_variants("loss_ablations.sh"))
    assert {"bf16", "fp8_mlp"} <= set(_variants("fp8_step.sh"))


@pytest.mark.parametrize("script, variant", CASES, ids=[f"{s}:{v}" for s, v in CASES])
def test_variant_parses_and_builds(script, variant, tmp_path):
    flags = _flags(script, variant)
    cfg = config.parse(["--preset", "small-gpu", "--data-dir", str(tmp_path), *flags])
    with torch.device("meta"):
        GPT(cfg.model)


def test_an_unknown_variant_is_refused():
    result = subprocess.run(
        ["bash", "-c", f"eval \"$(sed -n '/^variant_flags() {{/,/^}}/p' {GPU / 'loss_ablations.sh'})\"; "
         "variant_flags no_such_variant"], capture_output=True, text=True)
    assert result.returncode == 2 and "unknown variant 'no_such_variant'" in result.stderr
