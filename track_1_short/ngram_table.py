"""The n-gram embedding's names as the step-graph seed imports them (shared/reference/
step_graphs_seed.py: `from track_1_short.ngram_table import MAX_CYCLE_STEPS, NGRAM_DIM, NgramTable`).

The code lives in two layers: the model-side lookup (model/ngram_lookup.py: hashing, the row
cache, `gather`, the gradient sinks `grad_sink` / `sinks`, tensor ops only) and the trainer's
systems-side store (perf/ngram_store.py: the table shards, the row pull, the held gradients, the
update event and its sparse Adam). The seed's `NgramTable` is the part the step graphs use, the
lookup (`grad_sink`, `sinks`); the config is model/ngram_config.py. Nothing is defined here.
"""

from track_1_short.constants import MAX_CYCLE_STEPS
from track_1_short.model.ngram_config import NGRAM_DIM, NgramConfig
from track_1_short.model.ngram_lookup import NgramLookup as NgramTable

__all__ = ["MAX_CYCLE_STEPS", "NGRAM_DIM", "NgramConfig", "NgramTable"]
