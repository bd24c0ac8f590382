"""NgramStore: the systems side of the n-gram embedding, owned by the trainer: the table (this
rank's row shard), which rank owns which rows, the row pull into the model's row cache, the
gradients held until the update event, and the update event with its sparse Adam state.

What it replaces: HEAD modded-nanogpt's dense `bigram_embed` update (dense Adam every 2nd step on a
377,280 x 768 gradient, a hand-rolled sparse gradient exchange and a dense all_gather of the whole
table; facts 1.2 and 4.3). Here the gradients of up to MAX_CYCLE_STEPS steps are held and applied
at once as a sparse (lazy) Adam update of the touched rows. With W ranks rank r stores only rows
[r*ROWS/W, (r+1)*ROWS/W) of the table and its Adam state; nothing dense is ever all-gathered.
The model holds only the lookup (model/ngram_lookup.py: hashing, the row cache, the sinks), so
the model stays single-device; this store writes the lookup's cache and nothing else of the model.

Sharding (`shard(rank, world_size, group)`, called by the trainer after building the store and
before warmup/capture; it REPLACES `table`, `exp_avg`, `exp_avg_sq` by this rank's row slice).
ROWS = bigram_rows + trigram_rows must be a multiple of W (ValueError naming both otherwise; no
padding). Row i is owned by rank i // (ROWS / W). With W = 1 no collective is ever issued and the
code paths are the ones of the local table.

Row pull, two phases (all collectives are torch.distributed.all_to_all_single: NCCL on GPU, gloo on
CPU; gloo supports it for int64/float64/float32/bfloat16 with uneven splits in torch 2.13, checked):
- phase A, `request_rows(ids) -> RowRequest` (ids only, so it may run any time before phase B, e.g.
  for the next micro-batch between this micro-step's forward and backward; perf/row_prefetch.py):
  unique the [2T] ids (sorted, hence grouped by owner), exchange per-owner counts (a host sync of the
  current stream on the counts; RowPrefetch issues phase A on a CUDA side stream, so it waits for the
  next batch's copy and ids, not for the forward replay), then the ids themselves (async).
- phase B, inside `slots_for(inputs, ids, request)` (eager, right before the forward that uses the
  rows): owners gather the requested rows from their slice and send them back (all_to_all_single);
  the rank scatters them into the lookup's `cache[:2T]` in place. Phase B reads the table when it
  runs, so rows always reflect every update event issued before it: an event at step s is applied
  before step s+1's slots_for, whatever phase A did earlier (tested across events in
  test_ngram_sharded.py).

Rows inside the step (one rank, `rows_in_step`; TrainConfig.ngram_rows_in_step): with no
collective to make, the row pull and the held gradient's sum are device work like any other of
the micro-step, so the step runner runs them inside its forward and backward (captured into the
step graphs, so a stage-A micro-step launches no eager n-gram kernel): `pull_(inputs, ids, slots)`
at the head of the forward (row ids, the cache rows, the packed slots, written in place) and
`accumulate_(grad, ids)` at the tail of the backward. The trainer then only counts the hold
(`hold(None, None)`). Both are the same functions `slots_for` and `hold` run around the step.

Held gradients (`hold(grad [2T, R], ids [2T])`, right after each backward): summed at once into
a dense row accumulator `grad_acc` [ROWS, R] (index_add_, or with `accumulate="vector_atomic"`
or `"sorted"` a kernel of kernels/row_accumulate.py) and the rows flagged in `touched` [ROWS], so the sink
gradient is read before the next backward replay rewrites the graph's buffer (no copy, no ring;
the accumulator is 2.3 GB at the speedrun's table, the ring it replaced held cycle x micro-steps
gradients, 4.8 GB at stage C). The bound is built at construction from the
schedule's cycle and the run's micro-steps (`NgramStore(lookup, cycle=ScheduleConfig.ngram_cycle,
micro_steps=RunSpec.micro_steps)`): `max_held = cycle x micro_steps`, exactly reached on the last
micro-step of a (non-final) event step. A hold past it is a RuntimeError: an event the plan has
(StepPlan.ngram_event) was skipped.

Update event (`update_event(step, lr_scale)`, collective, on the schedule's `ngram_event` steps
after the optimizer): SparseAdam's formula on the touched rows, with the accumulated gradient
(NgramConfig.update "dense": on every row, a zero gradient where untouched, as HEAD's dense Adam).
- W = 1 on CUDA: two Triton kernels (kernels/ngram_adam.py): one lists the touched rows into a
  fixed-capacity scratch (`event_rows`, its count `event_count` on the device), a persistent one
  runs Adam on the listed rows, reads the step count on the device and zeroes the accumulator
  behind itself: no host sync, no data-dependent shape.
- Otherwise (`_event_reference`; the CPU, every W > 1, and the kernel's parity reference): the
  touched rows are listed (nonzero, a host sync), gathered, and for W > 1 sent to their owners
  (all_to_all_single of counts, ids, rows); the owner sums the contributions of all ranks and
  divides by W (AVG, as the dense parameters' reductions; the loss is scaled by 1 / micro_steps,
  so W ranks with 8/W micro-steps see the mean gradient one rank sees with 8), then updates them.
`num_updates` (the bias correction step) counts events and is the same on every rank. No event
refreshes the row cache: slots_for refills cache[:2T] from the table before every forward.

What must stay stable: nothing here is baked into a graph (the cache and the sinks are the
lookup's). The table slice, the Adam state and the accumulator are buffers updated in place after
shard(); the trainer checkpoints `state_dict()` (table, exp_avg, exp_avg_sq: this rank's rows;
num_updates) per rank, beside the model's, at boundaries where nothing is held (the accumulator
is zero there, so it is not saved).

Call order per micro-step (train.py; see perf/row_prefetch.py for the prefetching form):
ids = lookup.row_ids(inputs); slots = slots_for(inputs, ids) (eager, before the forward,
collective when W > 1); after the backward hold(sink_grad, ids); after the step's optimizer, on an
event step: update_event(step) (collective when W > 1). reset() after warmup. Every rank must make
the same sequence of collective calls (slots_for, update_event).

Legend: T tokens, R row width, N held n-grams (sum of 2T), U unique rows, W world size, Q rows
requested from this rank.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from track_1_short.config import NGRAM_ACCUMULATES
from track_1_short.model.ngram_lookup import NgramLookup


@dataclass(slots=True)
class RowRequest:
    """Phase A of a row pull (ids exchanged, rows not yet); consumed by slots_for (phase B)."""
    ids: Tensor  # [2T] table rows of the micro-batch (global ids)
    wanted: Tensor  # [U] unique ids, sorted, hence grouped by owner
    inverse: Tensor  # [2T] position of ids[j] in wanted
    send_counts: list[int]  # [W] ids this rank asked of each owner
    recv_counts: list[int]  # [W] ids each rank asked of this rank
    served: Tensor  # [Q] global ids other ranks asked of this rank (valid after work.wait())
    work: object | None  # async all_to_all handle of `served` (None when complete)


def _exchange_counts(counts: Tensor, group) -> list[int]:
    """all_to_all of one count per rank: [W] sent -> [W] received, as host ints (one host sync)."""
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts, group=group)
    return recv.tolist()


def _exchange(send: Tensor, send_counts: list[int], recv_counts: list[int], group,
              async_op: bool = False) -> tuple[Tensor, object | None]:
    """all_to_all_single along dim 0 with uneven splits: [sum send_counts, ...] -> [sum recv_counts, ...]."""
    recv = send.new_empty((sum(recv_counts), *send.shape[1:]))
    work = dist.all_to_all_single(recv, send.contiguous(), recv_counts, send_counts, group=group,
                                  async_op=async_op)
    return recv, work


def _event_kernel():
    from track_1_short.kernels.ngram_adam import sparse_adam_rows  # Triton: CUDA hosts only
    return sparse_adam_rows


def resolve_accumulate(name: str, device: torch.device, dtype: torch.dtype = torch.float32) -> str:
    """TrainConfig.ngram_accumulate for a row accumulator of `dtype` on `device`: "auto" is
    "vector_atomic" for a float32 accumulator on CUDA (0.45x index_add_'s time at stage C and
    0.47x at A on the H200, docs/results/ngram_vector_atomic_h200_2026-12-03/) and "index_add"
    otherwise (the kernels take float32 on CUDA); any other name as it is, where its kernel can
    run (else a ValueError naming the setting)."""
    if name not in NGRAM_ACCUMULATES:
        raise ValueError(f"NgramStore: accumulate={name!r}: one of {NGRAM_ACCUMULATES} "
                         f"(TrainConfig.ngram_accumulate)")
    kernels_run = device.type == "cuda" and dtype == torch.float32
    if name == "auto":
        return "vector_atomic" if kernels_run else "index_add"
    if name != "index_add" and not kernels_run:
        raise ValueError(f"NgramStore: accumulate={name!r} is a CUDA kernel for a float32 "
                         f"accumulator, this one is {dtype} on {device}; use 'index_add' or "
                         f"'auto' (train.ngram_accumulate)")
    return name


def _accumulate_kernel(name: str):
    """The hold's row accumulation for a resolved name: None for index_add_ (scalar atomics; the
    reference), else a kernels/row_accumulate.py kernel (Triton imported there):
    "vector_atomic" (four columns per atomic) or "sorted" (atomic-free, deterministic)."""
    if name == "index_add":
        return None
    from track_1_short.kernels import row_accumulate
    return {"sorted": row_accumulate.row_accumulate_,
            "vector_atomic": row_accumulate.row_accumulate_vector_}[name]


def _sum_duplicates(ids: Tensor, grads: Tensor) -> tuple[Tensor, Tensor]:
    """[N] ids, [N, R] grads -> [U] unique ids (sorted), [U, R] summed grads."""
    rows, inverse = ids.unique(return_inverse=True)
    g = grads.new_zeros(rows.numel(), grads.shape[1])
    return rows, g.index_add_(0, inverse, grads)


class NgramStore(nn.Module):
    """Concern: the n-gram table as state of the training system: this rank's rows and their
    sparse Adam moments, the row pull into the lookup's cache, the held sink gradients and the
    update events that apply them."""

    def __init__(self, lookup: NgramLookup, *, cycle: int, micro_steps: int,
                 accumulate: str = "auto"):
        """`cycle`: steps between update events (ScheduleConfig.ngram_cycle); `micro_steps`: held
        gradients per step (RunSpec.micro_steps). Both only bound the held gradients.
        `accumulate`: how accumulate_ sums a sink gradient into grad_acc (TrainConfig.
        ngram_accumulate, one of config.NGRAM_ACCUMULATES; resolve_accumulate): "auto"
        (vector_atomic on CUDA, else index_add), "index_add" (index_add_, float32
        atomics), "vector_atomic" (CUDA: kernels/row_accumulate.py, four columns per atomic) or
        "sorted" (CUDA: the same module, a sort and one add per distinct row, no atomics,
        deterministic)."""
        super().__init__()
        if cycle < 1 or micro_steps < 1:
            raise ValueError(f"NgramStore: cycle={cycle} (ScheduleConfig.ngram_cycle) and "
                             f"micro_steps={micro_steps} must be >= 1")
        self.cycle, self.micro_steps = cycle, micro_steps
        cfg = self.cfg = lookup.cfg
        # A reference, not a submodule: the lookup is the GPT's (its state_dict and the census).
        self.__dict__["lookup"] = lookup
        device = lookup.cache.device
        state_dtype = torch.promote_types(cfg.dtype, torch.float32)
        rows_dim = (cfg.num_rows, cfg.dim)
        self.register_buffer("table", torch.zeros(rows_dim, dtype=cfg.dtype, device=device))
        self.register_buffer("exp_avg", torch.zeros(rows_dim, dtype=state_dtype, device=device))
        self.register_buffer("exp_avg_sq", torch.zeros(rows_dim, dtype=state_dtype, device=device))
        self.register_buffer("num_updates", torch.zeros((), dtype=torch.int64, device=device))
        # The held gradients, summed per row as they arrive: [ROWS, R] over the whole table (also
        # when sharded: a micro-batch touches any row) and the rows' touched flags [ROWS].
        self.register_buffer("grad_acc", torch.zeros(rows_dim, dtype=state_dtype, device=device),
                             persistent=False)
        self.register_buffer("touched", torch.zeros(cfg.num_rows, dtype=torch.int32, device=device),
                             persistent=False)
        # The event kernel's scratch (its touched rows listed [ROWS] and their count [1]).
        self.register_buffer("event_rows", torch.zeros(cfg.num_rows, dtype=torch.int32, device=device),
                             persistent=False)
        self.register_buffer("event_count", torch.zeros(1, dtype=torch.int32, device=device),
                             persistent=False)
        self.pending = 0  # micro-step gradients in grad_acc since the last event
        # The event's kernel on one CUDA rank (kernels/ngram_adam.py; Triton is imported only on
        # CUDA hosts); None runs the reference. Tests set it to compare the two.
        self.event_kernel = _event_kernel() if device.type == "cuda" else None
        self.accumulate = resolve_accumulate(accumulate, device, state_dtype)  # what accumulate_ runs
        self.accumulate_kernel = _accumulate_kernel(self.accumulate)
        self.rank, self.world_size, self.group = 0, 1, None
        self.row_lo, self.rows_per_rank = 0, cfg.num_rows  # this rank's slice [row_lo, +rows_per_rank)

    # ---- sharding (once, after construction, before warmup and capture) ----

    @torch.no_grad()
    def shard(self, rank: int, world_size: int, group=None) -> None:
        """Keep only rows [rank*ROWS/W, (rank+1)*ROWS/W) of the table and its Adam state (the old
        full buffers are dropped: call before anything is captured or censused)."""
        rows = self.cfg.num_rows
        if world_size < 1 or rows % world_size:
            raise ValueError(f"world size {world_size} does not divide the n-gram table's {rows} rows "
                             f"(NgramConfig.bigram_rows + trigram_rows); make them a multiple of it")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside [0, {world_size})")
        if self.world_size != 1:
            raise RuntimeError(f"NgramStore already sharded over {self.world_size} ranks")
        per = rows // world_size
        lo = rank * per
        for name in ("table", "exp_avg", "exp_avg_sq"):
            setattr(self, name, getattr(self, name)[lo:lo + per].clone())  # replaces the buffer
        self.rank, self.world_size, self.group = rank, world_size, group
        self.row_lo, self.rows_per_rank = lo, per

    @torch.no_grad()
    def request_rows(self, ids: Tensor) -> RowRequest | None:
        """Phase A (collective when W > 1, None when W == 1): send this micro-batch's unique row ids
        [U] to their owners. Reads no table value, so it may run before an update event whose rows
        it asks for. Host-syncs the current stream on the [W] counts (RowPrefetch runs it on a side
        stream so that sync does not wait for a queued forward replay)."""
        if self.world_size == 1:
            return None
        self.lookup.check_capacity(ids.numel())
        wanted, inverse = ids.unique(return_inverse=True)  # [U], [2T]
        send_counts, recv_counts = self._owner_counts(wanted)
        served, work = _exchange(wanted, send_counts, recv_counts, self.group, async_op=True)
        return RowRequest(ids=ids, wanted=wanted, inverse=inverse, send_counts=send_counts,
                          recv_counts=recv_counts, served=served, work=work)

    def _owner_counts(self, rows: Tensor) -> tuple[list[int], list[int]]:
        """Collective: [U] sorted global rows -> (rows this rank sends each owner, rows each rank
        sends this one), as host ints (the host syncs on them)."""
        counts = torch.bincount(rows // self.rows_per_rank, minlength=self.world_size)  # [W]
        return counts.tolist(), _exchange_counts(counts, self.group)

    def _pull_rows(self, request: RowRequest) -> Tensor:
        """Phase B (collective): owners send the requested rows -> [U, R] in `wanted` order."""
        if request.work is not None:
            request.work.wait()  # the current stream waits for the id exchange
            request.work = None
        payload = self.table[request.served - self.row_lo]  # [Q, R] from this rank's slice
        rows, _ = _exchange(payload, request.recv_counts, request.send_counts, self.group)
        return rows  # [U, R]

    @torch.no_grad()
    def slots_for(self, inputs: Tensor, ids: Tensor | None = None,
                  request: RowRequest | None = None) -> Tensor:
        """Fill the lookup's cache[:2T] in place with this micro-batch's rows (phase B; phase A too
        when no `request` is given); returns ngram_slots int64 [2T]. Collective when W > 1."""
        lookup = self.lookup
        ids = lookup.row_ids(inputs) if ids is None else ids
        n = ids.numel()
        lookup.check_capacity(n)
        cache = lookup.cache[:n]  # [2T, R], contiguous: the gathers write it directly
        if self.world_size == 1:
            torch.index_select(self.table, 0, ids, out=cache)
        else:
            if request is None:
                request = self.request_rows(ids)
            elif request.ids is not ids:
                raise RuntimeError("slots_for: the row request was made for other ids (prefetch order)")
            torch.index_select(self._pull_rows(request), 0, request.inverse, out=cache)
        return lookup.slots(inputs)

    # ---- held gradients and update events (eager, after the backward) ----

    @property
    def num_pending(self) -> int:
        """Micro-step gradients accumulated since the last update event."""
        return self.pending

    @property
    def max_held(self) -> int:
        """Most micro-step gradients between two events: cycle x micro_steps."""
        return self.cycle * self.micro_steps

    @torch.no_grad()
    def hold(self, ngram_grad: Tensor | None, ids: Tensor | None):
        """Add one micro-step's sink gradient [2T, R] into the row accumulator at its row ids [2T]
        (accumulate_) and count it against the bound. Reads ngram_grad now (the caller may
        overwrite it after: the next backward replay does). hold(None, None): the step runner
        already added it inside its backward (rows_in_step); only counted here."""
        # An explicit raise (must survive python -O): an event of the plan was skipped.
        if self.pending >= self.max_held:
            raise RuntimeError(f"{self.pending + 1} held n-gram gradients > cycle {self.cycle} x "
                               f"micro_steps {self.micro_steps}; an update event was missed")
        if (ngram_grad is None) != (ids is None):
            raise ValueError("NgramStore.hold: give both the sink gradient and its row ids, or "
                             "neither (the step runner added them inside the step)")
        if ids is not None:
            self.accumulate_(ngram_grad, ids)
        self.pending += 1

    # ---- rows inside the step (one rank: no collective, no host sync, capture-safe) ----

    @property
    def rows_in_step(self) -> bool:
        """Whether the step runner may pull and hold the rows inside its forward and backward:
        one rank (with several, the pull is a collective and stays around the step)."""
        return self.world_size == 1

    @torch.no_grad()
    def pull_(self, inputs: Tensor, ids_out: Tensor, slots_out: Tensor) -> None:
        """One rank: `inputs`' row ids into ids_out [2T], their rows into the lookup's cache[:2T],
        the packed slots into slots_out [2T] (slots_for's work, written in place so that a step
        graph can own the buffers). No host sync: the step runner captures it."""
        if not self.rows_in_step:
            raise RuntimeError(f"NgramStore.pull_ runs on one rank; with {self.world_size} the "
                               f"rows come from their owners (slots_for, a collective)")
        ids_out.copy_(self.lookup.row_ids(inputs))
        slots_out.copy_(self.slots_for(inputs, ids_out))

    @torch.no_grad()
    def accumulate_(self, ngram_grad: Tensor, ids: Tensor) -> None:
        """The device half of hold: the sink gradient [2T, R] added into grad_acc at its row ids
        [2T], the rows marked touched (the bigram half [T] alone without trigrams: the reserved
        trigram row's lazy Adam step would be a no-op). No host sync: the step runner captures it
        at the tail of its backward with rows_in_step."""
        ids, ngram_grad = self.lookup.read_rows(ids, ngram_grad)
        grad = ngram_grad.to(self.grad_acc.dtype)
        if self.accumulate_kernel is not None:
            self.accumulate_kernel(self.grad_acc, ids, grad)  # [ROWS, R]
        else:
            self.grad_acc.index_add_(0, ids, grad)  # [ROWS, R]
        self.touched.index_fill_(0, ids, 1)  # [ROWS]

    def baked_tensors(self):
        """(role, tensor) of what pull_ and accumulate_ read and write besides the model's buffers:
        a step graph that runs them bakes these addresses (StepGraphs.baked_tensors lists them)."""
        for name in ("table", "grad_acc", "touched"):
            yield f"ngram_store.{name}", getattr(self, name)

    def _to_owners(self, rows: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
        """Collective: [U] global rows + [U, R] grads -> this rank's touched rows (local indices,
        [U']) and their gradient summed over ranks and averaged over W ([U', R])."""
        send_counts, recv_counts = self._owner_counts(rows)
        recv_ids, _ = _exchange(rows, send_counts, recv_counts, self.group)  # [sum recv]
        recv_g, _ = _exchange(g, send_counts, recv_counts, self.group)  # [sum recv, R]
        local, summed = _sum_duplicates(recv_ids - self.row_lo, recv_g)
        return local, summed.div_(self.world_size)

    def _adam_rows(self, local: Tensor, g: Tensor, lr_scale: float):
        """SparseAdam on slice rows `local` [U] with gradient g [U, R] (eps added to sqrt(v) before
        bias correction, as torch.optim.SparseAdam), plus the cautious decay of
        NgramConfig.weight_decay. The reference of kernels/ngram_adam.py."""
        cfg = self.cfg
        t = int(self.num_updates)
        lr, eff_wd = self._lr_and_decay(lr_scale)
        m = self.exp_avg[local].mul_(cfg.beta1).add_(g, alpha=1 - cfg.beta1)
        v = self.exp_avg_sq[local].mul_(cfg.beta2).addcmul_(g, g, value=1 - cfg.beta2)
        self.exp_avg[local] = m
        self.exp_avg_sq[local] = v
        step_size = lr * (1 - cfg.beta2 ** t) ** 0.5 / (1 - cfg.beta1 ** t)
        update = m / (v.sqrt() + cfg.eps) * step_size
        p = self.table[local].to(update.dtype)
        decay = torch.where(update * p > 0, p * eff_wd, 0.0)
        self.table[local] = (p - update - decay).to(self.table.dtype)

    def _lr_and_decay(self, lr_scale: float) -> tuple[float, float]:
        """This event's lr and cautious decay factor (lr^2 x NgramConfig.weight_decay, as the
        optimizer's Adam rule), for the kernel and the reference alike."""
        lr = self.cfg.lr * lr_scale
        return lr, lr * lr * self.cfg.weight_decay

    def _event_reference(self, lr_scale: float):
        """The event by gathers and scatters (host syncs on the touched rows and the step count):
        the CPU path, every W > 1 (the rows go to their owners), and the kernel's reference.
        NgramConfig.update "dense": every row of the slice, a zero gradient where untouched."""
        rows = self.touched.nonzero().squeeze(1)  # [U] sorted global rows
        g = self.grad_acc[rows]  # [U, R]
        self.grad_acc.index_fill_(0, rows, 0)
        self.touched.index_fill_(0, rows, 0)
        if self.world_size > 1:
            rows, g = self._to_owners(rows, g)  # local rows of this slice
        if self.cfg.update == "dense":
            full = g.new_zeros(self.rows_per_rank, g.shape[1])  # [ROWS / W, R]
            rows, g = torch.arange(self.rows_per_rank, device=g.device), full.index_add_(0, rows, g)
        self._adam_rows(rows, g, lr_scale)

    @torch.no_grad()
    def update_event(self, step: int, lr_scale: float = 1.0):
        """Sparse (lazy) Adam on the rows touched since the last event (collective when W > 1: the
        row gradients go to their owners first). On one CUDA rank two kernels (list the touched
        rows, Adam on them; kernels/ngram_adam.py), no host sync. The row cache is not refreshed:
        slots_for refills it from the table before every forward."""
        if not self.pending:
            raise RuntimeError(f"step {step}: n-gram update event with no held gradients")
        self.num_updates += 1
        if self.world_size == 1 and self.event_kernel is not None:
            cfg = self.cfg
            lr, eff_wd = self._lr_and_decay(lr_scale)
            self.event_kernel(self.table, self.exp_avg, self.exp_avg_sq, self.grad_acc, self.touched,
                              self.num_updates, self.event_rows, self.event_count, lr=lr,
                              beta1=cfg.beta1, beta2=cfg.beta2, eps=cfg.eps, eff_wd=eff_wd,
                              dense=cfg.update == "dense")
        else:
            self._event_reference(lr_scale)
        self.pending = 0

    @torch.no_grad()
    def reset(self):
        """Initial state in place: zero table slice (HEAD's init), Adam state, accumulator; nothing
        held. Sharding and every address are kept (the lookup's reset() zeroes the cache)."""
        for buf in (self.table, self.exp_avg, self.exp_avg_sq, self.num_updates, self.grad_acc,
                    self.touched):
            buf.zero_()
        self.pending = 0
