"""Shared helpers of the GPU benchmarks bench/model.py and bench/step_graphs.py.

What is here: the per-rank key shapes of DESIGN section 3 (from SPEEDRUN_STAGES; tiny ones for
--smoke), a synthetic packed batch builder (random ids < 50257, BOS-led documents of FineWeb-like
lognormal lengths cut at max_seq_len, cum_seqlens padded with T, as data.TrainStream packs them),
the trainer's model build (trainer/build.py: bf16 matrices on CUDA), YaRN set to a key's stage,
step timing with CUDA events, kernel time from a torch.profiler trace, dynamo compile counters,
machine info, and a result file rewritten atomically after every unit of work (so a run killed
at its time limit still leaves JSON with its command).

Nothing here runs at import time; `setup_torch` (called from main()) raises dynamo's recompile
limit (the step-graph bench compiles the forward once per key and per compile mode: 5 keys x 2
modes > the default 8) and points inductor's cache at build/inductor_cache (git-ignored, kept
between calls on a warm machine, so a second run skips most of the compile).

Legend: T tokens per rank per micro-step, C cu_seqlens rows.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import sys
import time
import traceback
import types
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bench import results_io
from track_1_short import config as config_mod
from track_1_short.atomic_io import write_json_atomic
from track_1_short.model.tokens import BOS_ID, GPT2_VOCAB
from track_1_short.data import Batch
from track_1_short.model.gpt import ForwardScheduleConfig
from track_1_short.model.gpt_config import GPTConfig
from track_1_short.model.ngram_config import NgramConfig
from track_1_short.perf import profiling
from track_1_short.report import code_identity
from track_1_short.schedule import SPEEDRUN_STAGES

DOC_MEDIAN_TOKENS = 400  # lognormal(ln 400, 1.0): mean ~660 GPT-2 tokens, about FineWeb's
DOC_SIGMA = 1.0
SMOKE_VOCAB = 512
# Synthetic batches use the record's per-key document capacities (facts 2.2: max_num_docs
# {16384: 64, 32768: 96, 49152: 128}), the cu_seqlens lengths its kernels were measured with; the
# trainer sizes its own from the data (trainer/preflight.py).
RECORD_CU_SEQLENS_ROWS = {16384: 64, 32768: 96, 49152: 128}

# --smoke: the speedrun's four stages (MTP, prefix and lr structure kept) at tiny shapes:
# (tokens_per_rank, ws_short, ws_long, max_seq_len) per stage, one step each.
SMOKE_SHAPES = ((256, 128, 256, 128), (384, 128, 384, 256), (512, 256, 512, 256), (512, 256, 640, 256))
SMOKE_STAGES = tuple(
    dataclasses.replace(stage, num_steps=1, tokens_per_rank=t, ws_short=ws, ws_long=wl,
                        max_seq_len=msl, cu_seqlens_rows=8)
    for stage, (t, ws, wl, msl) in zip(SPEEDRUN_STAGES, SMOKE_SHAPES))


@dataclass(slots=True, frozen=True, kw_only=True)
class KeySpec:
    """One benchmarked key: a stage's per-rank shapes and its first step's schedule values."""

    name: str  # "A".."D", or "A_half" (stage A at half the tokens: the 16-GPU regime)
    tokens: int  # T
    cu_seqlens_rows: int  # C
    ws_short: int
    ws_long: int
    max_seq_len: int
    mtp_weights: tuple[float, ...]
    prefix_weight: float
    ws_long_chain: tuple[int, ...]  # ws_long of every stage up to this one (YaRN is applied along it)


def key_specs(smoke: bool) -> dict[str, KeySpec]:
    stages = SMOKE_STAGES if smoke else SPEEDRUN_STAGES
    out = {}
    for i, s in enumerate(stages):
        rows = s.cu_seqlens_rows or RECORD_CU_SEQLENS_ROWS[s.tokens_per_rank]
        out[s.name] = KeySpec(name=s.name, tokens=s.tokens_per_rank, cu_seqlens_rows=rows,
                              ws_short=s.ws_short, ws_long=s.ws_long, max_seq_len=s.max_seq_len,
                              mtp_weights=s.mtp_weights_start, prefix_weight=s.prefix_weight_start,
                              ws_long_chain=tuple(t.ws_long for t in stages[:i + 1]))
    a = out["A"]
    out["A_half"] = dataclasses.replace(a, name="A_half", tokens=a.tokens // 2,
                                        max_seq_len=min(a.max_seq_len, a.tokens // 2))
    return out


def select_specs(names: str, smoke: bool, half_key: bool) -> list[KeySpec]:
    """Keys in run order: A_half first (it shares A's windows), then by stage, so YaRN only moves
    forward within one pass."""
    specs = key_specs(smoke)
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    bad = [n for n in wanted if n not in specs]
    if bad:
        raise SystemExit(f"--keys: unknown {bad}; choose from {sorted(specs)}")
    if half_key and "A_half" not in wanted:
        wanted.insert(0, "A_half")
    order = ["A_half", "A", "B", "C", "D"]
    return [specs[n] for n in sorted(dict.fromkeys(wanted), key=order.index)]


def synthetic_batch(spec: KeySpec, device: torch.device, seed: int, vocab: int = GPT2_VOCAB,
                    bos: int = BOS_ID) -> tuple[Batch, list[int]]:
    """A packed batch as data.TrainStream builds it: documents (BOS + random ids < 50257) of
    lognormal lengths, each cut at max_seq_len, the last cut to fill T + 1 tokens; inputs =
    slice[:-1], targets = slice[1:], cum_seqlens = [0, piece starts..., T, T, ...] (C rows).
    Redraws until the pieces fit the key's C - 1 documents. Returns the batch and the lengths of
    the non-empty pieces. `vocab`/`bos`: the smoke model's small vocabulary."""
    rng = np.random.default_rng(seed)
    for _ in range(100):
        lengths, filled = [], 0
        while filled < spec.tokens + 1:
            n = int(np.clip(rng.lognormal(np.log(DOC_MEDIAN_TOKENS), DOC_SIGMA), 2, spec.max_seq_len))
            n = min(n, spec.tokens + 1 - filled)
            lengths.append(n)
            filled += n
        if len(lengths) <= spec.cu_seqlens_rows - 1:
            break
    else:
        raise ValueError(f"key {spec.name}: could not draw documents that fit {spec.cu_seqlens_rows} "
                         f"cu_seqlens rows")
    tokens = rng.integers(0, vocab - 1, spec.tokens + 1)  # < 50256, BOS placed below
    starts = np.cumsum([0] + lengths[:-1])
    tokens[starts] = bos
    cu = np.full(spec.cu_seqlens_rows, spec.tokens, dtype=np.int32)
    cu[:len(starts)] = starts
    t = torch.from_numpy(tokens)
    batch = Batch(inputs=t[:-1].to(torch.int32).to(device), targets=t[1:].to(torch.int64).to(device),
                  cum_seqlens=torch.from_numpy(cu).to(device))
    # the last piece ends at T (its final token is only a target; a 1-token piece is empty)
    pieces = [n for n in lengths[:-1] + [lengths[-1] - 1] if n > 0]
    return batch, pieces


def model_batch(spec: KeySpec, model, device: torch.device, seed: int) -> tuple[Batch, list[int]]:
    """synthetic_batch with the model's vocabulary and BOS (GPT-2's except in --smoke)."""
    c = model.config
    return synthetic_batch(spec, device, seed, vocab=min(GPT2_VOCAB, c.vocab_size), bos=c.ngram.bos_id)


def forward_config(spec: KeySpec, device: torch.device) -> ForwardScheduleConfig:
    return ForwardScheduleConfig(
        mtp_weights=torch.tensor(spec.mtp_weights, dtype=torch.float32, device=device),
        prefix_weight=torch.tensor(spec.prefix_weight, dtype=torch.float32, device=device),
        ws_short=spec.ws_short, ws_long=spec.ws_long,
        train_max_seq_len=spec.max_seq_len)


def set_yarn(model, spec: KeySpec) -> None:
    """YaRN tables and attention scales as the trainer has them at the key's stage: reset, then the
    same window changes in the same order (so the floats are bitwise the trainer's)."""
    model.reset_yarn()
    for old, new in zip(spec.ws_long_chain, spec.ws_long_chain[1:]):
        model.apply_window_change(old, new)


# ---------------------------------------------------------------- setup

def setup_torch(device: torch.device) -> dict:
    """Process-wide settings of a bench run (never at import). Returns what was set, for the JSON."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                          str(Path(__file__).resolve().parents[1] / "build" / "inductor_cache"))
    dynamo = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # name changed across torch versions
        if hasattr(dynamo, name):
            setattr(dynamo, name, max(64, getattr(dynamo, name)))
    if device.type == "cpu":
        # --smoke: tiny shapes are latency-bound; extra intra-op threads only spin on a busy CI box
        # (measured: 40 ms vs 2.3 s per forward with 2 threads on 2 loaded cores)
        torch.set_num_threads(1)
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)  # "cuda" without an index: set_device refuses it
        # Initialise CUPTI before any graph capture, so kernels inside replayed graphs are traced.
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]):
            torch.ones(1, device=device).add_(1)
        torch.cuda.synchronize()
    return {"TORCHINDUCTOR_CACHE_DIR": os.environ["TORCHINDUCTOR_CACHE_DIR"],
            "dynamo_recompile_limit": getattr(dynamo, "recompile_limit", None)}


def build_bench_model(smoke: bool, device: torch.device, attention: str | None, fp8: bool | None):
    """The trainer's model: the speedrun preset's GPTConfig (cpu-tiny's for --smoke), built as the
    trainer builds it (trainer/build.py: seeded; bf16 banks/embeddings/head on CUDA, attention
    backend and fp8 resolved)."""
    from track_1_short.trainer.build import build_model, prepare_for_device
    cfg = config_mod.preset("cpu-tiny" if smoke else "speedrun")
    if smoke:  # a 512-token vocabulary keeps the CPU smoke run to seconds
        cfg.model = GPTConfig.tiny(vocab_size=SMOKE_VOCAB, ngram=NgramConfig(
            vocab_size=SMOKE_VOCAB, dim=128, bigram_rows=1024, trigram_rows=1024,
            cache_rows=2 * 1024, bos_id=SMOKE_VOCAB - 1))
    if attention is not None:
        cfg.model.attention_backend = attention
    if fp8 is not None:
        cfg.model.fp8.enabled = fp8
    return cfg, prepare_for_device(build_model(cfg, device), device)


# ---------------------------------------------------------------- measurement

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step_fn, num_steps: int, device: torch.device) -> dict:
    """Run step_fn(i) num_steps times. Per-step ms from CUDA events recorded at step boundaries
    (no sync inside the loop), and host wall ms per step = (end - start) / num_steps with a
    synchronize at both ends (what the user sees)."""
    cuda = device.type == "cuda"
    marks = []
    sync(device)
    start = time.perf_counter()
    for i in range(num_steps):
        marks.append(_mark(cuda))
        step_fn(i)
    marks.append(_mark(cuda))
    sync(device)
    wall_ms = (time.perf_counter() - start) * 1e3 / num_steps
    per_step = [_elapsed(a, b, cuda) for a, b in zip(marks, marks[1:])]
    return {**summarize(per_step), "wall_ms": wall_ms}


def _mark(cuda: bool):
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _elapsed(a, b, cuda: bool) -> float:
    return a.elapsed_time(b) if cuda else (b - a) * 1e3


def summarize(xs: list[float]) -> dict:
    s = sorted(xs)
    q = lambda f: s[min(len(s) - 1, int(f * len(s)))]
    return {"median_ms": statistics.median(s), "p10_ms": q(0.1), "p90_ms": q(0.9),
            "mean_ms": statistics.fmean(s), "min_ms": s[0], "max_ms": s[-1], "n": len(s)}


def device_events(step_fn, num_steps: int, device: torch.device) -> list[dict]:
    """The chrome-trace events of num_steps calls step_fn(i), profiled (CUDA activity only)."""
    sync(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(num_steps):
            step_fn(i)
        sync(device)
    return profiling.trace_events(prof)


def device_time_ms(step_fn, num_steps: int, device: torch.device, top: int = 0) -> dict:
    """Profile num_steps calls (device_events) and summarise them with profiling.kernel_stats:
    kernel ms, device-busy ms (interval union) and launches per step; top > 0 adds the `top`
    kernels by total time."""
    return profiling.kernel_stats(device_events(step_fn, num_steps, device), num_steps, top)


def compile_counters() -> dict[str, int]:
    """Flattened torch._dynamo.utils.counters ("group.name" -> count)."""
    from torch._dynamo.utils import counters
    return {f"{g}.{k}": int(v) for g, c in counters.items() for k, v in c.items()
            if isinstance(v, (int, float))}


def counter_diff(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def recompiles(diff: dict[str, int]) -> int:
    """New dynamo graphs (stats.unique_graphs) plus new AOTAutograd compiles in a window."""
    return diff.get("stats.unique_graphs", 0) + diff.get("aot_autograd.total", 0)


def memory_gib(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"max_allocated_gib": None, "max_reserved_gib": None, "reserved_gib": None}
    return {"max_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
            "max_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
            "reserved_gib": torch.cuda.memory_reserved(device) / 2**30}


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


# ---------------------------------------------------------------- provenance and output

def command() -> str:
    """This process's command line (PYTHONPATH kept), run by the running interpreter."""
    return results_io.command_line(Path(sys.executable).name)


def machine_info(device: torch.device) -> dict:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    info = {"torch": torch.__version__, "triton": triton_version, "cuda": torch.version.cuda,
            "python": platform.python_version(), "host": platform.node(),
            "cpu_count": os.cpu_count(), **code_identity(), "device": str(device),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_gib=props.total_memory / 2**30,
                    sm_count=props.multi_processor_count)
    return info


class Results:
    """The output JSON, rewritten atomically after every unit so a killed run still leaves it."""

    def __init__(self, path: Path, device: torch.device, **header):
        self.path = path
        self.data = {"command": command(), "machine": machine_info(device), **header,
                     "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "complete": False}
        self.save()

    def save(self) -> None:
        write_json_atomic(self.path, self.data)


class UsageError(Exception):
    """A bad flag or input: main() prints it and exits 2."""


def measure_and_write(prog: str, args, measure) -> dict | None:
    """A one-measurement bench's run (the n-gram and kernel benches): CUDA unless args.smoke,
    measure(args), then the JSON (command, machine, what measure returned) written atomically to
    args.out and returned; None, after a message naming `prog` on stderr, where the run must exit
    2 (no GPU, a UsageError)."""
    device = torch.device("cpu" if args.smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"{prog}: needs a CUDA GPU; on the CPU run it with --smoke", file=sys.stderr)
        return None
    try:
        measured = measure(args)
    except UsageError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return None
    result = {"command": command(), "machine": machine_info(device), **measured}
    write_json_atomic(Path(args.out), result)
    return result


def load_module_file(path: str, repo_path: str, name: str,
                     rename: tuple[str, str] | None = None) -> types.ModuleType:
    """The Python file `path` (an earlier version of the project's `repo_path`, for a bench's A/B)
    executed as module `name`, with the text `rename[0]` replaced by `rename[1]` first (e.g. a
    custom-op namespace, so both versions register side by side); UsageError if there is no file."""
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"--baseline-kernel {path}: no such file (write it with git show "
                         f"REV:{repo_path} > {path})")
    source = file.read_text()
    if rename is not None:
        source = source.replace(*rename)
    module = types.ModuleType(name)
    module.__file__ = str(file)
    sys.modules[name] = module  # dataclasses look their module up while it executes
    exec(compile(source, str(file), "exec"), module.__dict__)  # noqa: S102 - a measuring instrument
    return module


def run_guarded(label: str, fn, errors: dict) -> object:
    """fn(); on an exception record 'Type: message' (+ traceback tail) under errors[label] and
    return None, so one failing part never aborts the others."""
    try:
        return fn()
    except Exception as error:  # noqa: BLE001 - a bench records every failure and moves on
        tail = traceback.format_exc().strip().splitlines()[-12:]
        errors[label] = {"error": f"{type(error).__name__}: {error}"[:2000], "traceback": tail}
        print(f"[{label}] FAILED: {type(error).__name__}: {str(error)[:300]}", flush=True)
        return None


def print_table(rows: list[dict], columns: list[str]) -> None:
    def cell(v):
        return f"{v:.3f}" if isinstance(v, float) else ("-" if v is None else str(v))
    text = [columns] + [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(r[i]) for r in text) for i in range(len(columns))]
    for r in text:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)), flush=True)
