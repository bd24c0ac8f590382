"""Capture hygiene and the graph backend: how step_graphs.py captures, independent of the device.

What it replaces: the bare `with torch.cuda.graph(...)` blocks of record #360's `_CGraphRunner`,
which leave four known failure classes to the user (cuda_graph_anchors.md section 4): Python GC
running finalizers mid-capture (pain point 7; PyTorch stopped calling gc.collect() before
captures, pytorch PR #161037), other threads allocating pinned memory during a global-mode capture
(pain point 6; the data loader does), host syncs inside the captured region that surface as
"operation not permitted when stream is capturing" with no hint of which graph or why (pain point
5), and warm iterations on a different stream than the capture. Here every capture gets, by
default: GC paused, device synchronized before and after, a side stream shared by warm iterations
and capture, `capture_error_mode="thread_local"`, and capture errors re-raised as CaptureError
naming the key, the phase and the usual host-sync culprits. Optionally the warm iterations after
the first (compilation) run under `torch.cuda.set_sync_debug_mode("error")`, which points at the
offending line before the capture does.

The GRAPH BACKEND abstraction lets step_graphs.py and optimizer_graphs.py run unchanged on CPU
in tests:
    CudaGraphBackend        torch.cuda.CUDAGraph, torch.cuda.graph(..., thread_local), one pool
    RecordingGraphBackend   CPU stand-in (library code, used by tests/test_step_graphs.py and
                            tests/test_optimizer_graphs.py): the "capture" runs the callables
                            once and records them; replay() re-runs them and writes the results
                            INTO the tensors the capture returned, so
                            outputs live at fixed addresses and are overwritten by every replay,
                            and inputs are read from the static buffers at replay time, as on the
                            GPU. What it cannot reproduce: a graph baking a Python value or a stale
                            address (it re-runs Python, so it reads everything live). Those are
                            covered by the YaRN attention-scale checks, the census
                            (baked_addresses.py) and the GPU tests (tests/test_step_graphs_gpu.py).

What must stay stable: `loss_grads` is the one definition of the captured backward; warm
iterations, both backends' captures and the eager twin all call it. retain_graph/create_graph stay
False: AOTAutograd compiles the backward with donated buffers and refuses otherwise (record #360).

Call order: StepGraphs._capture (warmup only): `warm_up(...)` on the side stream, then
`backend.capture_pair(...)` inside `paused_gc()`. OptimizerGraphs._capture (optimizer_graphs.py)
likewise, with `backend.capture_call(...)`: one callable (AnvilAndAdam.run_step) per graph.

Provenance: record #360 (`_CGraphRunner` capture code); Megatron/torchtitan thread_local capture
and GC freeze; anchors section 5 item 7 ("capture hygiene by default").
"""

import gc
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

# Defined with the config (torch-free); imported here under the seed's name for it.
from track_1_short.perf.cuda_graphs.graphs_config import WARM_ITERATIONS  # noqa: F401

# Substrings of the errors CUDA/PyTorch raise when a captured region does something a capture
# forbids (a host sync, a blocking allocation, a query of the capturing stream).
_CAPTURE_ERROR_MARKERS = (
    "operation not permitted when stream is capturing",
    "cudaErrorStreamCapture",
    "stream is capturing",
    "during CUDA graph capture",
    "previous error during capture",  # cudaErrorStreamCaptureInvalidated, raised by capture_end
)


class StepGraphError(RuntimeError):
    """A guard that protects replay correctness failed. Raised explicitly (never `assert`), so it
    survives `python -O`."""


class CaptureError(StepGraphError):
    """A capture failed; the message names the key and the phase."""


def loss_grads(loss: Tensor, leaves: Sequence[Tensor]) -> tuple[Tensor | None, ...]:
    """The captured backward: gradients of the scalar loss w.r.t. `leaves` (None for unused ones,
    e.g. the value-embedding table, whose gradient goes to ValueEmbedPull.grad_accum)."""
    return torch.autograd.grad(loss, list(leaves), allow_unused=True)


@contextmanager
def paused_gc() -> Iterator[None]:
    """No Python GC (and so no finalizer freeing CUDA memory or graphs) during a capture."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextmanager
def translate_capture_errors(key: object, phase: str, graph: str = "step graph",
                             region: str = "the captured forward/backward") -> Iterator[None]:
    """Re-raise a capture-forbidden operation as a CaptureError that says where to look."""
    try:
        yield
    except RuntimeError as error:
        # torch.cuda.graph's __exit__ ends the capture even after an error, so the first failure
        # may sit in __context__ behind capture_end's "invalidated" error.
        messages = [str(error), str(error.__context__ or "")]
        if isinstance(error, StepGraphError) or not any(
                marker in message for marker in _CAPTURE_ERROR_MARKERS for message in messages):
            raise
        raise CaptureError(
            f"capture of the {phase} of {graph} {key} failed: a host sync or capture-forbidden "
            f"operation ran inside {region} (.item(), .cpu(), .tolist(), "
            f"nonzero, boolean-mask indexing, print of a CUDA tensor, a blocking pinned "
            f"allocation). Find it with --graphs off and torch.cuda.set_sync_debug_mode('error'). "
            f"Original error: {error}") from error


AfterBackward = Callable[[tuple[Tensor | None, ...]], None]  # in-place work on a backward's gradients


@dataclass(slots=True)
class CapturedPair:
    loss: Tensor  # forward output (graph memory: every forward replay overwrites it)
    grads: tuple[Tensor | None, ...]  # backward outputs, one per leaf (graph memory)
    pool_bytes_added: int | None  # memory_reserved growth during the capture; None off-GPU


class GraphBackend(Protocol):
    def new_graph(self) -> Any: ...
    def new_stream(self, device: torch.device | None) -> Any: ...
    def stream_context(self, stream: Any) -> Any: ...
    def current_stream(self) -> Any: ...
    def pool_handle(self) -> Any: ...
    def synchronize(self) -> None: ...
    def memory_reserved(self) -> int | None: ...
    def sync_debug(self) -> Any: ...

    def capture_pair(self, forward: Any, backward: Any, loss_fn: Callable[[], Tensor],
                     leaves: Sequence[Tensor], *, pool: Any, stream: Any, key: object,
                     after_backward: AfterBackward | None = None) -> CapturedPair:
        """The forward graph runs loss_fn, the backward graph loss_grads of its loss w.r.t. the
        leaves, then after_backward(grads) when given (in-place work on the gradients: the
        n-gram rows' sum with rows in the step)."""

    def capture_call(self, graph: Any, fn: Callable[[], object], *, pool: Any, stream: Any,
                     key: object, graph_kind: str) -> int | None: ...


class CudaGraphBackend:
    """Real CUDA graphs, all keys in one memory pool."""

    def new_graph(self) -> torch.cuda.CUDAGraph:
        return torch.cuda.CUDAGraph()

    def new_stream(self, device: torch.device | None) -> torch.cuda.Stream:
        return torch.cuda.Stream(device)

    def stream_context(self, stream: torch.cuda.Stream):
        return torch.cuda.stream(stream)

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream()

    def pool_handle(self):
        return torch.cuda.graph_pool_handle()

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def memory_reserved(self) -> int:
        return torch.cuda.memory_reserved()

    @contextmanager
    def sync_debug(self) -> Iterator[None]:
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)

    def capture_pair(self, forward, backward, loss_fn, leaves, *, pool, stream, key,
                     after_backward=None):
        torch.cuda.synchronize()
        # torch.cuda.graph empties the cache on entry too; doing it first makes the delta below
        # the pool's growth rather than the release of the warm iterations' cached blocks.
        torch.cuda.empty_cache()
        reserved_before = torch.cuda.memory_reserved()
        # thread_local: the loader threads may allocate pinned memory while we capture.
        with translate_capture_errors(key, "forward"), torch.cuda.graph(
                forward, pool=pool, stream=stream, capture_error_mode="thread_local"):
            loss = loss_fn()
        with translate_capture_errors(key, "backward"), torch.cuda.graph(
                backward, pool=pool, stream=stream, capture_error_mode="thread_local"):
            grads = loss_grads(loss, leaves)
            if after_backward is not None:
                after_backward(grads)
        torch.cuda.synchronize()
        return CapturedPair(loss, grads, torch.cuda.memory_reserved() - reserved_before)

    def capture_call(self, graph, fn, *, pool, stream, key, graph_kind):
        """One callable into `graph` (its outputs are in-place writes); returns the pool growth in
        bytes. Used by optimizer_graphs.py for AnvilAndAdam.run_step."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # as in capture_pair: the delta is the pool's growth
        reserved_before = torch.cuda.memory_reserved()
        with translate_capture_errors(key, "step", graph_kind, "the captured callable"), \
                torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            fn()
        torch.cuda.synchronize()
        return torch.cuda.memory_reserved() - reserved_before


class FakeStream:
    def wait_stream(self, other: "FakeStream") -> None:
        pass


class FakeGraph:
    """CPU stand-in for torch.cuda.CUDAGraph: replay() re-runs what the capture recorded."""

    def __init__(self):
        self.num_replays = 0
        self._replay: Callable[[], None] | None = None

    def replay(self) -> None:
        if self._replay is None:
            raise StepGraphError("replay of a FakeGraph that was never captured")
        self.num_replays += 1
        self._replay()


class RecordingGraphBackend:
    """CPU stand-in with CUDA-graph output semantics (see the module docstring). One difference:
    its "capture" executes the step once (a real capture only records), so in-place side effects
    of the backward (value_embeds' grad_accum, after_backward's n-gram sum) happen once more than
    on the GPU; the post-warmup reset clears them in both cases."""

    def new_graph(self) -> FakeGraph:
        return FakeGraph()

    def new_stream(self, device: torch.device | None) -> FakeStream:
        return FakeStream()

    def stream_context(self, stream: FakeStream):
        return nullcontext()

    def current_stream(self) -> FakeStream:
        return FakeStream()

    def pool_handle(self) -> object:
        return object()

    def synchronize(self) -> None:
        pass

    def memory_reserved(self) -> None:
        return None

    def sync_debug(self):
        return nullcontext()

    def capture_pair(self, forward: FakeGraph, backward: FakeGraph, loss_fn, leaves, *, pool,
                     stream, key, after_backward=None):
        with translate_capture_errors(key, "forward"):
            loss = loss_fn()
        with translate_capture_errors(key, "backward"):
            grads = loss_grads(loss, leaves)
            if after_backward is not None:
                after_backward(grads)
        # The autograd graph of the latest forward replay, consumed by the next backward replay
        # (a real backward graph replays kernels that read the forward's saved pool buffers).
        live: list[Tensor] = []

        def replay_forward():
            with torch.enable_grad():
                fresh = loss_fn()
            loss.detach().copy_(fresh.detach())
            live[:] = [fresh]

        def replay_backward():
            if not live:
                raise StepGraphError(f"backward replay of {key} without a forward replay")
            for out, fresh in zip(grads, loss_grads(live.pop(), leaves)):
                if (out is None) != (fresh is None):
                    raise StepGraphError(f"{key}: gradient presence changed since capture")
                if out is not None:
                    out.copy_(fresh)
            if after_backward is not None:
                after_backward(grads)

        forward._replay, backward._replay = replay_forward, replay_backward
        return CapturedPair(loss, grads, None)

    def capture_call(self, graph: FakeGraph, fn, *, pool, stream, key, graph_kind) -> None:
        """Runs `fn` once (a real capture only records it) and replays re-run it: in-place outputs
        land where the capture wrote them, inputs are read at replay time."""
        with translate_capture_errors(key, "step", graph_kind, "the captured callable"):
            fn()
        graph._replay = fn
        return None


def warm_up(backend: GraphBackend, stream: Any, step_fn: Callable[[], object], iterations: int,
            sync_debug: bool) -> float:
    """Run `step_fn` (forward + backward of the key) `iterations` times on the capture's side
    stream; returns the last iteration's wall time in ms (device-synchronized), the eager
    reference for the capture report. With `sync_debug`, iterations after the first (which
    compiles, and compilation may synchronize) run under set_sync_debug_mode("error")."""
    stream.wait_stream(backend.current_stream())
    elapsed_ms = float("nan")
    with backend.stream_context(stream):
        for i in range(iterations):
            backend.synchronize()
            start = time.perf_counter()
            with backend.sync_debug() if sync_debug and i > 0 else nullcontext():
                step_fn()
            backend.synchronize()
            elapsed_ms = (time.perf_counter() - start) * 1e3
    backend.current_stream().wait_stream(stream)
    backend.synchronize()
    return elapsed_ms
