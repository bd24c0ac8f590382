"""The systems constants shared across the package, defined once.

What it replaces: the same numbers written in several modules (the reference world size in
data.py and distributed.py, the held-gradient bound in schedule.py and ngram_table.py with a
test that the copies agree). Every module that needs one imports it from here, so a copy can no
longer drift. The model's token facts (BOS, vocabulary sizes, the attention block) are in
model/tokens.py, so model/ imports only model/.

What must stay stable: this module imports nothing (no torch, no package module), so anything
above model/ may import it (tests/test_layering.py enforces it).
"""

REFERENCE_WORLD_SIZE = 8  # the speedrun's ranks: per-rank shapes are one of 8 ranks' (slices per step)
# Most steps an n-gram gradient may be held (accumulated) before its update event: the bound on
# the schedule's n-gram cycle.
MAX_CYCLE_STEPS = 8
H200_DENSE_BF16_TFLOPS = 790.0  # measured on this workplace's H200s (8192^3 bf16 matmul): MFU denominator
