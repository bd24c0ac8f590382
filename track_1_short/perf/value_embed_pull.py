"""ValueEmbedPull under the name the step-graph seed imports (`from
track_1_short.perf.value_embed_pull import ValueEmbedPull`). The gather with its custom backward
into the persistent `grad_accum` is model math (single device, tensor ops), so it lives in
model/value_embed.py; this module defines nothing.
"""

from track_1_short.model.value_embed import ValueEmbedPull

__all__ = ["ValueEmbedPull"]
