"""Constants shared across the package, defined once: the bottom floor of the layering.

What it replaces: the same numbers written in several modules (BOS in data.py and ngram_table.py,
the reference world size in data.py and distributed.py, the held-gradient bound in schedule.py and
ngram_table.py with a test that the copies agree). Every module that needs one imports it from
here, so a copy can no longer drift.

What must stay stable: this module imports nothing (no torch, no package module), so anything may
import it, `model/` included (tests/test_layering.py enforces both rules).
"""

BOS_ID = 50256  # GPT-2 <|endoftext|>, placed before every document (the tokenizer's EOT_ID)
GPT2_VOCAB = 50257  # token ids 0..50256 (shard files hold ids below this)
PADDED_VOCAB = 50304  # GPT2_VOCAB padded to a multiple of 128: the model's embedding rows
REFERENCE_WORLD_SIZE = 8  # the speedrun's ranks: per-rank shapes are one of 8 ranks' (slices per step)
BLOCK_TOKENS = 128  # FlexAttention tile in tokens; attention windows are whole blocks
# Most steps an n-gram gradient may be held before its update event: the length of the step
# graphs' held-gradient ring, and the bound on the schedule's and the n-gram config's cycle.
MAX_CYCLE_STEPS = 8
H200_DENSE_BF16_TFLOPS = 790.0  # measured on this workplace's H200s (8192^3 bf16 matmul): MFU denominator
