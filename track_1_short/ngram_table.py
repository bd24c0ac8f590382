"""NgramTable: hashed bigram and trigram embedding rows, a per-step row cache, gradient sinks and
sparse Adam update events (single device; a later version shards the rows across ranks).

What it replaces: HEAD modded-nanogpt's dense `bigram_embed` parameter (377,280 x 768, updated by
dense Adam every 2nd step, with a hand-rolled sparse gradient exchange; facts 1.2 and 4.3). Here the
table is a buffer, not a Parameter: the forward only reads a row cache, its gradient comes out of a
zeros "sink" leaf added to the gathered rows (one [2T, R] gradient per step instead of a dense
[ROWS, R] one), and the gradients of up to MAX_CYCLE_STEPS steps are held and applied at once as a
sparse (lazy) Adam update of the touched rows at the table's update event.

Hashing (facts 1.2, extended with trigrams): each token t_i gets 2 rows, laid out in ngram_slots as
[bigram rows of all T tokens, then trigram rows]:
- bigram  ((36313 t_i) XOR (27191 t_{i-1})) mod (B - 1), rows [0, B-1); trigram
  ((36313 t_i) XOR (27191 t_{i-1}) XOR (51497 t_{i-2})) mod (G - 1) + B, rows [B, B+G-1).
- n-grams never cross a BOS (50256): a BOS token, the token right after it (and the first token of the
  batch) have no bigram context and take the reserved row B-1; a token without two context tokens
  after the last BOS takes the reserved trigram row B+G-1. (HEAD hashes across BOS; deviation.)
- sign trick: a fixed seeded +-1 buffer `sign` [SIGN_ROWS, R]; n-gram j multiplies its gathered row by
  sign[(t_i XOR t_{i-1}) mod SIGN_ROWS] (bigram) or sign[(t_i XOR t_{i-1} XOR 7 t_{i-2}) mod SIGN_ROWS]
  (trigram), 0 for no context, so colliding n-grams partly cancel instead of adding up.
- ngram_slots packs both indices: slot * SIGN_ROWS + sign index (one int64 tensor the step graphs
  copy into their static buffer). This local version does not deduplicate: slot j holds row ids[j].

What must stay address-stable (the step graphs bake them): `cache` [cache_rows, R] (refilled in
place by slots_for and update_event), `sign`, and every sink in `self.sinks` (one zeros leaf per token
count, never reallocated; reset() only zeroes them). The master table and Adam state are buffers
updated in place (never read by a graph, but censused as model buffers).

Call order per step (train.py): ids = row_ids(inputs); slots = slots_for(inputs, ids) (eager, before
the forward); forward gathers with gather(slots, grad_sink(T)); after the backward
hold(sink_grad, ids); if is_event(step): update_event(step). reset() after warmup.

Legend: T tokens, R row width (NGRAM_DIM for the speedrun), B bigram rows, G trigram rows,
U touched rows at an event, S sign rows.
"""

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

NGRAM_DIM = 768
MAX_CYCLE_STEPS = 8
SIGN_ROWS = 8192
BOS_ID = 50256
_M_CUR, _M_PREV, _M_PREV2 = 36313, 27191, 51497


@dataclass(slots=True, kw_only=True)
class NgramConfig:
    vocab_size: int = 50304
    dim: int = NGRAM_DIM  # row width R; must equal the model dim (rows are added to the residual)
    bigram_rows: int = 377_280  # HEAD: 50304 * 15 // 2, last row reserved for "no context"
    trigram_rows: int = 377_280  # ours (not in HEAD), last row reserved
    cache_rows: int = 2 * 49_152  # >= 2T of the largest step
    cycle: int = 2  # update event every `cycle` steps (sinks held in between)
    micro_steps: int = 1  # backward passes per step (gradient accumulation): held per cycle x this
    lr: float = 0.6  # HEAD bigram_embed: base 0.008 x lr_mul 75
    beta1: float = 0.75
    beta2: float = 0.95
    eps: float = 1e-10
    dtype: torch.dtype = torch.float32  # table, cache and sinks; Adam state is >= float32
    seed: int = 0  # sign buffer generator seed (identical on every rank without a broadcast)
    bos_id: int = BOS_ID

    def __post_init__(self):
        if not 1 <= self.cycle <= MAX_CYCLE_STEPS:
            raise ValueError(f"NgramConfig.cycle={self.cycle} must be in [1, {MAX_CYCLE_STEPS}]")
        for name in ("bigram_rows", "trigram_rows"):
            if getattr(self, name) < 2:
                raise ValueError(f"NgramConfig.{name}={getattr(self, name)} must be >= 2")
        if self.cache_rows < 2:
            raise ValueError(f"NgramConfig.cache_rows={self.cache_rows} must be >= 2 (2 per token)")

    @property
    def num_rows(self) -> int:
        return self.bigram_rows + self.trigram_rows


@dataclass(slots=True)
class _Held:
    grads: list[Tensor] = field(default_factory=list)  # [2T, R] each (caller-owned memory)
    ids: list[Tensor] = field(default_factory=list)  # [2T] each


class NgramTable(nn.Module):
    def __init__(self, cfg: NgramConfig):
        super().__init__()
        self.cfg = cfg
        state_dtype = torch.promote_types(cfg.dtype, torch.float32)
        g = torch.Generator().manual_seed(cfg.seed)
        sign = torch.randint(0, 2, (SIGN_ROWS, cfg.dim), generator=g).to(cfg.dtype) * 2 - 1
        self.register_buffer("table", torch.zeros(cfg.num_rows, cfg.dim, dtype=cfg.dtype))
        self.register_buffer("exp_avg", torch.zeros(cfg.num_rows, cfg.dim, dtype=state_dtype))
        self.register_buffer("exp_avg_sq", torch.zeros(cfg.num_rows, cfg.dim, dtype=state_dtype))
        self.register_buffer("num_updates", torch.zeros((), dtype=torch.int64))
        self.register_buffer("sign", sign)  # [S, R]
        self.register_buffer("cache", torch.zeros(cfg.cache_rows, cfg.dim, dtype=cfg.dtype),
                             persistent=False)  # [cache_rows, R]
        self.register_buffer("cache_ids", torch.zeros(cfg.cache_rows, dtype=torch.int64),
                             persistent=False)  # [cache_rows] table row held by each cache row
        self.sinks: dict[int, Tensor] = {}
        self.held = _Held()

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
        if 2 * inputs.numel() > self.cfg.cache_rows:
            raise ValueError(f"batch of {inputs.numel()} tokens needs {2 * inputs.numel()} cache rows > "
                             f"NgramConfig.cache_rows={self.cfg.cache_rows}; raise cache_rows")

    def _contexts(self, inputs: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        tok = inputs.long()  # [T]
        bos = torch.full((2,), self.cfg.bos_id, dtype=torch.int64, device=tok.device)
        prev = torch.cat([bos[:1], tok[:-1]])  # [T]
        prev2 = torch.cat([bos, tok[:-2]])[: tok.numel()]  # [T]
        bos_id = self.cfg.bos_id
        bigram_ok = (tok != bos_id) & (prev != bos_id)  # [T]
        trigram_ok = bigram_ok & (prev2 != bos_id)  # [T]
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

    def sign_ids(self, inputs: Tensor) -> Tensor:
        """Sign-buffer row of every n-gram: int64 [2T] (0 without context)."""
        tok, prev, prev2, bigram_ok, trigram_ok = self._contexts(inputs)
        big = torch.where(bigram_ok, (tok ^ prev) % SIGN_ROWS, 0)
        tri = torch.where(trigram_ok, (tok ^ prev ^ (7 * prev2)) % SIGN_ROWS, 0)
        return torch.cat([big, tri])

    @torch.no_grad()
    def slots_for(self, inputs: Tensor, ids: Tensor | None = None) -> Tensor:
        """Fill the cache in place with this step's rows; returns ngram_slots int64 [2T]."""
        ids = self.row_ids(inputs) if ids is None else ids
        n = ids.numel()
        self.cache_ids[:n].copy_(ids)
        self.cache[:n].copy_(self.table[ids])
        slots = torch.arange(n, device=ids.device, dtype=torch.int64)
        return slots * SIGN_ROWS + self.sign_ids(inputs)

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
        """[2T] packed slots (+ sink [2T, R]) -> [T, R]: signed bigram row + signed trigram row."""
        rows = self.cache[ngram_slots // SIGN_ROWS]  # [2T, R]
        if sink is not None:
            rows = rows + sink
        rows = rows * self.sign[ngram_slots % SIGN_ROWS]
        return rows.view(2, -1, rows.shape[-1]).sum(0)

    # ---- held gradients and update events (eager, after the backward) ----

    @property
    def num_pending(self) -> int:
        return len(self.held.ids)

    def is_event(self, step: int) -> bool:
        return (step + 1) % self.cfg.cycle == 0

    def hold(self, ngram_grad: Tensor, ids: Tensor):
        """Keep one step's sink gradient [2T, R] and its row ids [2T] until the update event. The
        caller must not overwrite ngram_grad before then (StepGraphs.hold_ngram_grad copies it)."""
        # The step graphs' ring has cycle x micro_steps slots; one more held gradient would alias a
        # live one (an explicit raise: this guard must survive python -O).
        bound = self.cfg.cycle * self.cfg.micro_steps
        if self.num_pending >= bound:
            raise RuntimeError(f"{self.num_pending + 1} held n-gram gradients > cycle {self.cfg.cycle} x "
                               f"micro_steps {self.cfg.micro_steps}; an update event was missed")
        self.held.grads.append(ngram_grad)
        self.held.ids.append(ids)

    @torch.no_grad()
    def update_event(self, step: int, lr_scale: float = 1.0):
        """Sparse (lazy) Adam on the rows touched since the last event, then refresh the cache.
        Same formula as torch.optim.SparseAdam (eps added to sqrt(v) before bias correction)."""
        assert self.held.ids, f"step {step}: n-gram update event with no held gradients"
        cfg = self.cfg
        ids = torch.cat(self.held.ids)  # [sum 2T]
        grads = torch.cat(self.held.grads).to(self.exp_avg.dtype)
        rows, inverse = ids.unique(return_inverse=True)  # [U]
        g = torch.zeros(rows.numel(), cfg.dim, dtype=grads.dtype, device=grads.device)
        g.index_add_(0, inverse, grads)  # [U, R]
        self.num_updates += 1
        t = int(self.num_updates)
        m = self.exp_avg[rows].mul_(cfg.beta1).add_(g, alpha=1 - cfg.beta1)
        v = self.exp_avg_sq[rows].mul_(cfg.beta2).addcmul_(g, g, value=1 - cfg.beta2)
        self.exp_avg[rows] = m
        self.exp_avg_sq[rows] = v
        step_size = cfg.lr * lr_scale * (1 - cfg.beta2 ** t) ** 0.5 / (1 - cfg.beta1 ** t)
        update = m / (v.sqrt() + cfg.eps) * step_size
        self.table[rows] = (self.table[rows].to(update.dtype) - update).to(self.table.dtype)
        self.held.grads.clear()
        self.held.ids.clear()
        self.cache.copy_(self.table[self.cache_ids])

    @torch.no_grad()
    def reset(self):
        """Initial state in place: zero table (HEAD's init), Adam state, cache, sinks; nothing held."""
        for buf in (self.table, self.exp_avg, self.exp_avg_sq, self.num_updates, self.cache,
                    self.cache_ids):
            buf.zero_()
        for sink in self.sinks.values():
            sink.zero_()
            sink.grad = None
        self.held.grads.clear()
        self.held.ids.clear()
