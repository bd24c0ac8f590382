"""The model's token facts, defined once: GPT-2 ids and vocabulary sizes, the attention block.

Torch-free and import-free, so every module may import it (model/ included: it is part of the
model floor; tests/test_layering.py checks it imports nothing). Systems constants (world size,
the held-gradient bound, the MFU denominator) are in track_1_short/constants.py.
"""

BOS_ID = 50256  # GPT-2 <|endoftext|>, placed before every document (the tokenizer's EOT_ID)
GPT2_VOCAB = 50257  # token ids 0..50256 (shard files hold ids below this)
PADDED_VOCAB = 50304  # GPT2_VOCAB padded to a multiple of 128: the model's embedding rows
BLOCK_TOKENS = 128  # FlexAttention tile in tokens; attention windows are whole blocks
