"""NgramConfig: the n-gram embedding's knobs, read by the model-side lookup (model/ngram_lookup.py:
hashing, row cache, sinks) and by the trainer's store (perf/ngram_store.py: table, sparse Adam).
Torch is imported for the dtype only; no runtime module of the package.

What must stay stable: nothing here holds tensors; validated when built (the message names the
field). Nested into GPTConfig.ngram (model/gpt_config.py). The update cadence is not here: the
events are the schedule's (ScheduleConfig.ngram_cycle, StepPlan.ngram_event), and the store's
held-gradient bound is built from that cycle and the run's micro-steps (NgramStore's arguments).
"""

from dataclasses import dataclass

import torch

from track_1_short.model.tokens import BOS_ID, PADDED_VOCAB

NGRAM_DIM = 768  # the speedrun's row width (= model dim)
NGRAM_UPDATES = ("lazy", "dense")  # NgramConfig.update


@dataclass(slots=True, kw_only=True)
class NgramConfig:
    vocab_size: int = PADDED_VOCAB
    dim: int = NGRAM_DIM  # row width R; must equal the model dim (rows are added to the residual)
    bigram_rows: int = 377_280  # HEAD: 50304 * 15 // 2, last row reserved for "no context"
    trigram_rows: int = 377_280  # ours (not in HEAD), last row reserved
    cache_rows: int = 2 * 49_152  # >= 2T of the largest micro-batch
    lr: float = 0.6  # HEAD bigram_embed: base 0.008 x lr_mul 75
    beta1: float = 0.75
    beta2: float = 0.95
    eps: float = 1e-10
    # cautious weight decay of the update event's Adam: where the update and the row agree in
    # sign, the row also shrinks by (lr x the step's lr multiplier)^2 x weight_decay (the
    # optimizer's Adam rule, optim/anvil_math.adam_update_); 0: none (ours so far). HEAD's
    # bigram_embed: 0.005 x wd_mul 5 = 0.025; a loss-parity ablation until measured
    weight_decay: float = 0.0
    dtype: torch.dtype = torch.float32  # table, cache and sinks; Adam state is >= float32
    # the update event's Adam: "lazy" (only the rows touched since the last event move; ours) or
    # "dense" (every row, a zero gradient for the untouched: momentum keeps moving a row after
    # its last touch, as HEAD's dense Adam on bigram_embed); a loss-parity ablation until measured
    update: str = "lazy"
    # False: the bigram table alone (the lookup leaves the trigram half out); the trigram rows
    # are then dead (never read or moved), so set trigram_rows small too (8 in the record
    # profile, config.py): else the dense event sweeps them and they hold memory for nothing
    trigram: bool = True
    seed: int = 0  # sign buffer generator seed (identical on every rank without a broadcast)
    bos_id: int = BOS_ID

    def __post_init__(self):
        for name in ("bigram_rows", "trigram_rows"):
            if getattr(self, name) < 2:
                raise ValueError(f"NgramConfig.{name}={getattr(self, name)} must be >= 2")
        if self.weight_decay < 0:
            raise ValueError(f"NgramConfig.weight_decay={self.weight_decay} must be >= 0")
        if self.update not in NGRAM_UPDATES:
            raise ValueError(f"NgramConfig.update={self.update!r}: one of {NGRAM_UPDATES}")
        if self.cache_rows < 2:
            raise ValueError(f"NgramConfig.cache_rows={self.cache_rows} must be >= 2 (2 per token)")

    @property
    def num_rows(self) -> int:
        return self.bigram_rows + self.trigram_rows
