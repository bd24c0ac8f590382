"""NgramLookup: the model side of the hashed bigram and trigram embedding: contexts -> row ids and
signs, the device row cache the forward reads, and the gradient sinks. Tensor ops only: no rank, no
collective, no optimizer state (the table, its shards and its sparse Adam are the trainer's
NgramStore, perf/ngram_store.py, which fills the cache).

What it replaces: HEAD modded-nanogpt's dense `bigram_embed` parameter (377,280 x 768, updated by
dense Adam every 2nd step, facts 1.2 and 4.3). Here the forward only reads a row cache, and its
gradient comes out of a zeros "sink" leaf added to the gathered rows: one [2T, R] gradient per
micro-step instead of a dense [ROWS, R] one, which the store holds until its update event.

Hashing (facts 1.2, extended with trigrams): each token t_i gets 2 rows, laid out in ngram_slots as
[bigram rows of all T tokens, then trigram rows]:
- bigram  ((36313 t_i) XOR (27191 t_{i-1})) mod (B - 1), rows [0, B-1); trigram
  ((36313 t_i) XOR (27191 t_{i-1}) XOR (51497 t_{i-2})) mod (G - 1) + B, rows [B, B+G-1).
- NgramConfig.trigram False: the bigram table alone (an ablation): every trigram takes the
  reserved trigram row and the gather leaves the trigram half out (its sink gradient is zero).
- n-grams never cross a BOS (50256): a BOS token, the token right after it (and the first token of the
  batch) have no bigram context and take the reserved row B-1; a token without two context tokens
  after the last BOS takes the reserved trigram row B+G-1. (HEAD hashes across BOS; deviation.)
- sign trick: a fixed seeded +-1 buffer `sign` [S, R]; n-gram j multiplies its gathered row by
  sign[(t_i XOR t_{i-1}) mod S] (bigram) or sign[(t_i XOR t_{i-1} XOR 7 t_{i-2}) mod S]
  (trigram), 0 for no context, so colliding n-grams partly cancel instead of adding up. The seed is
  a config value, so every rank builds the same buffer without a broadcast.
- ngram_slots packs both indices: slot * S + sign index (one int64 tensor the step graphs copy into
  their static buffer). Cache slot j holds row ids[j] (no deduplication in the cache), so the slots,
  the cache contents and every gather are bit-identical for any world size.

What must stay address-stable (the step graphs bake them): `cache` [cache_rows, R] (the store
refills it in place), `sign`, and every sink in `self.sinks` (one zeros leaf per token count, never
reallocated; reset() only zeroes them).

Call order per micro-step: ids = row_ids(inputs) (eager, before the forward); the store fills
cache[:2T] with those rows and returns slots(inputs); the forward gathers with
gather(slots, grad_sink(T)); the sink's gradient goes to the store. reset() after warmup.

Legend: T tokens, R row width (NGRAM_DIM for the speedrun), B bigram rows, G trigram rows,
S sign rows.
"""

import torch
from torch import Tensor, nn

from track_1_short.model.ngram_config import NgramConfig

SIGN_ROWS = 8192
_M_CUR, _M_PREV, _M_PREV2 = 36313, 27191, 51497


class NgramLookup(nn.Module):
    """Concern: the model side of the n-gram embedding (tensor ops only): hashing contexts into
    row ids and signs, the row cache the forward gathers from, and the gradient sinks. Who owns
    the rows and updates them is perf/ngram_store.NgramStore's concern."""

    def __init__(self, cfg: NgramConfig):
        super().__init__()
        self.cfg = cfg
        g = torch.Generator().manual_seed(cfg.seed)
        sign = torch.randint(0, 2, (SIGN_ROWS, cfg.dim), generator=g).to(cfg.dtype) * 2 - 1
        self.register_buffer("sign", sign)  # [S, R]
        self.register_buffer("cache", torch.zeros(cfg.cache_rows, cfg.dim, dtype=cfg.dtype),
                             persistent=False)  # [cache_rows, R]
        self.sinks: dict[int, Tensor] = {}

    # ---- ids (eager, before the forward) ----

    def _check_tokens(self, inputs: Tensor):
        vocab = self.cfg.vocab_size
        if inputs.device.type == "cpu":
            bad = (inputs < 0) | (inputs >= vocab)
            if bool(bad.any()):
                raise ValueError(f"token id {int(inputs[bad][0])} outside [0, {vocab}) in the batch; "
                                 f"check the data shards or NgramConfig.vocab_size")
        else:
            # device tensor on the hot path: no host sync
            torch._assert_async(((inputs >= 0) & (inputs < vocab)).all(), "token id outside vocab")
        self.check_capacity(2 * inputs.numel())

    def check_capacity(self, num_ids: int):
        """ValueError naming cache_rows when `num_ids` rows do not fit the cache."""
        if num_ids > self.cfg.cache_rows:
            raise ValueError(f"batch of {num_ids // 2} tokens needs {num_ids} cache rows > "
                             f"NgramConfig.cache_rows={self.cfg.cache_rows}; raise cache_rows")

    def _contexts(self, inputs: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        tok = inputs.long()  # [T]
        bos = torch.full((2,), self.cfg.bos_id, dtype=torch.int64, device=tok.device)
        prev = torch.cat([bos[:1], tok[:-1]])  # [T]
        prev2 = torch.cat([bos, tok[:-2]])[: tok.numel()]  # [T]
        bos_id = self.cfg.bos_id
        bigram_ok = (tok != bos_id) & (prev != bos_id)  # [T]
        trigram_ok = bigram_ok & (prev2 != bos_id) & self.cfg.trigram  # [T]
        return tok, prev, prev2, bigram_ok, trigram_ok

    def row_ids(self, inputs: Tensor) -> Tensor:
        """Table rows of every token's bigram and trigram: int64 [2T] = [bigrams, trigrams]."""
        self._check_tokens(inputs)
        tok, prev, prev2, bigram_ok, trigram_ok = self._contexts(inputs)
        b, g = self.cfg.bigram_rows, self.cfg.trigram_rows
        h2 = (_M_CUR * tok) ^ (_M_PREV * prev)
        h3 = h2 ^ (_M_PREV2 * prev2)
        big = torch.where(bigram_ok, h2 % (b - 1), b - 1)
        tri = torch.where(trigram_ok, h3 % (g - 1) + b, b + g - 1)
        return torch.cat([big, tri])

    def read_rows(self, ids: Tensor, sink_grad: Tensor) -> tuple[Tensor, Tensor]:
        """The part of a micro-step's row ids [2T] and sink gradient [2T, R] that the gather
        reads: both halves, or the bigram half ([T], [T, R]) without trigrams, whose trigram half
        is every token's reserved row with a zero gradient (adding it would be T atomic adds of 0
        into one row: with trigrams off an index_add kernel took 6.4 ms per stage-C step on the
        H200 against 4.8 with them, docs/results/step_variants_h200_2026-12-02_C.json, most
        likely the store's hold)."""
        if self.cfg.trigram:
            return ids, sink_grad
        half = ids.shape[0] // 2
        return ids[:half], sink_grad[:half]

    def sign_ids(self, inputs: Tensor) -> Tensor:
        """Sign-buffer row of every n-gram: int64 [2T] (0 without context)."""
        tok, prev, prev2, bigram_ok, trigram_ok = self._contexts(inputs)
        big = torch.where(bigram_ok, (tok ^ prev) % SIGN_ROWS, 0)
        tri = torch.where(trigram_ok, (tok ^ prev ^ (7 * prev2)) % SIGN_ROWS, 0)
        return torch.cat([big, tri])

    def slots(self, inputs: Tensor) -> Tensor:
        """ngram_slots int64 [2T] of a micro-batch whose rows sit in cache[:2T] in row_ids order:
        cache slot j packed with the sign index of n-gram j."""
        n = 2 * inputs.numel()
        return torch.arange(n, device=inputs.device, dtype=torch.int64) * SIGN_ROWS + self.sign_ids(inputs)

    # ---- inside the forward ----

    def grad_sink(self, num_tokens: int) -> Tensor:
        """The zeros leaf [2T, R] the forward adds to the rows; allocated once per T."""
        sink = self.sinks.get(num_tokens)
        if sink is None:
            sink = torch.zeros(2 * num_tokens, self.cfg.dim, dtype=self.cfg.dtype,
                               device=self.cache.device, requires_grad=True)
            self.sinks[num_tokens] = sink
        return sink

    def gather(self, ngram_slots: Tensor, sink: Tensor | None = None) -> Tensor:
        """[2T] packed slots (+ sink [2T, R]) -> [T, R]: signed bigram row + signed trigram row.
        Tensor ops only (runs inside the compiled, captured forward)."""
        rows = self.cache[ngram_slots // SIGN_ROWS]  # [2T, R]
        if sink is not None:
            rows = rows + sink
        rows = rows * self.sign[ngram_slots % SIGN_ROWS]
        rows = rows.view(2, -1, rows.shape[-1])  # [2, T, R]: bigrams, trigrams
        return rows.sum(0) if self.cfg.trigram else rows[0]

    @torch.no_grad()
    def reset(self):
        """Cache and sinks zeroed in place (every address kept); the store resets the table."""
        self.cache.zero_()
        for sink in self.sinks.values():
            sink.zero_()
            sink.grad = None
