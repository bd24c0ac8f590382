"""Our validation loss against the record's on the same corpus, schedule and validation tokens,
from one device call's raw outputs (scripts/gpu/loss_parity.sh): our trainer's run dir and the
record harness's loss.jsonl, written as docs/results/loss_parity_<corpus>_<date>.json.

What it replaces: overlaying two curves by eye, where a difference in data, schedule or
validation set would pass unnoticed. Both runs are checked to be comparable before anything is
written (exit 2 otherwise, naming both values): the same train corpus (token count), the same
stage boundaries (our preset's stages against the record's ITERS / EXT_ITERS split), the same
validation shard files, tokens per forward and token count.

When the data starts repeating matters: the corpora here are small (25.3M train tokens for
embedded-large), and a curve after the first repeated token measures memorization as much as
learning. Both loaders cut every document at the stage's max_seq_len and drop the rest, so an
epoch ends after fewer tokens than the corpus holds; the first repeat is found by walking each
loader's document order over the schedule:
- ours: data.TrainStream itself (seeded document order per epoch, every slice of every step);
  the first step that takes a document of the second epoch;
- the record: upstream's Shard.next_batch at world size 1 (documents in file order, 8
  micro-batches of T + 1 tokens per step); the first step whose micro-batch runs past the last
  BOS of the last train shard (upstream then reloads the cycled files). This assumes the shard's
  full BOS index is ready before its partial one (the first 6M tokens) runs out: the background
  scan of a 25M-token shard takes well under a second.
`repeats_at_step` is the earlier of the two; `repeats.token_count_bound` is the step at which
the tokens trained exceed the corpus (the later bound that ignores the cut documents). A
validation at step s runs before step s trains, so the points with step <= repeats_at_step saw
no repeated token on either side; `max_gap_before_repeat` is the signed (ours - record) gap of
largest size among them, at `max_gap_step`; `max_excess_before_repeat` {gap, step} the largest
ours - record among them (the parity criterion: ours <= the record's + 0.02 at every one).

Output (loss_parity_<corpus>[_<variant>]_<date>.json): command {script, builder, record}, corpus,
[variant,] corpus_tokens, val_tokens,
val_tokens_per_forward, record_val_backend, boundaries, stage_start_validation (ours: "next" as
the record, or "trained"), repeats_at_step, repeats {ours, record,
token_count_bound}, val [{step, ours, record}] at the steps both validated,
max_gap_before_repeat, max_gap_step, max_excess_before_repeat, transitions, train_gap,
complete {ours, record},
streams_differ_at_step (first_stream_difference: the first step at which the two trainers'
micro-batches hold different tokens; 0 with our seeded document order, null when every step before
the data runs out or the schedule ends trains both on the same tokens: data.shuffle false).

transitions: per stage boundary b (the first step of a stage) whose window [b-5, b+5) lies
before the first repeat, the train objective (the step's loss with its MTP and prefix terms, as
both trainers log it; ours needs --log-every 1, the harness logs every step near a boundary) of
each side: `before` (mean of steps b-5..b-1), `after` (steps b..b+4), `jump` = max(after) -
before, `recovered_at` (the first step >= b at or below `before`, null within the logged steps);
steps are 0-based on both sides (the harness's train record `step: k` is step k-1 done). A side
without every step of the window logged gives null.

train_gap: where both trainers train on the same tokens (streams_differ_at_step null or later)
the train objectives compare step for step, with far less noise than validation (the same
batch on both sides): per stage, over its steps before the first repeat and the first stream
difference that both logged, {stage, steps [first, last + 1), mean, sd, max, max_step} of
ours - record; null when the streams differ from step 0 (a shuffled order).

Pooled (`pool`, loss_parity_<corpus>[_<variant>]_pooled_<date>.json): several runs of each
side on the same tokens (the same configuration, checked: ours by config.json less the run's name
and diagnostics, the record by its harness settings less OUT_DIR), because one run per side
cannot decide a 0.02 criterion: two runs of one trainer on the same tokens differ by up to
0.04-0.05 in validation and by 0.1-0.2 in the train objective right after the A -> B boundary
(measured 2026-12-02, docs/results/README.md). Each run is checked against the other side as
`build` checks one pair. Fields: command, corpus, [variant,] runs {ours, record} (the inputs as
given), n {ours, record}, repeats_at_step, streams_differ_at_step, val [{step, ours, record, gap,
se, ours_runs, record_runs}] (ours / record: the side's mean, gap = their difference, se = the
gap's standard error from that step's own spread on each side, null with a side of one run: the
spread differs from step to step, e.g. ours ~0.002 at step 10 and ~0.03 at step 70 on
embedded-large),
run_to_run_sd {val {ours, record}, train {ours, record}} (pooled over the points before the
repeat: sqrt(sum over steps and runs of (x - the step's side mean)^2 / (steps x (n - 1))); null
for a side of one run; train: per stage as train_gap's stages), gap_se (the standard error of a
gap of means: sqrt(sd_ours^2 / n_ours + sd_record^2 / n_record), null without both sd),
max_excess_before_repeat {gap, step} (of the mean gap), over_margin_before_repeat (the steps whose
mean gap exceeds PARITY_MARGIN), self_excess_before_repeat {ours, record} (per run, {gap, step}:
the largest excess of that run over the mean of its own side's other runs before the repeat, the
criterion applied to a trainer against itself; null for a side of one run), train_gap
(train_gap of the two mean curves), train_spread {ours, record} ({step, spread}: the largest
max - min over one side's runs at one step on the same tokens), transitions [{step, ours [jump per run], record [jump per run], mean {ours,
record}}] (mean: of the runs' jumps that were measured).

Subcommands:
  build        the JSON above (scripts/gpu/loss_parity.sh after both runs)
  pool         the pooled JSON from several runs of each side (one --ours / --record per run)
  anchor-args  the record harness's KEY=VALUE settings that reproduce a preset's schedule, its
               Muon momentum ramp and our validation tokens on a data dir, one line, for run.sh
               (refused if the preset's stages are not the record's thirds + one extension)

Run: PYTHONPATH=. python bench/loss_parity.py build --ours OUT/runs/small-gpu-parity \\
         --record OUT/anchor --data-dir data/embedded-large --out-dir docs/results
     PYTHONPATH=. python bench/loss_parity.py pool --ours RUN1 --ours RUN2 \\
         --record LOSS1.jsonl --record LOSS2.jsonl --data-dir data/embedded-large --variant NAME
     PYTHONPATH=. python bench/loss_parity.py anchor-args --preset small-gpu \\
         --data-dir data/embedded-large --val-every 10
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.results_io import (InputError, add_output_args, builder_command, load_json, run_main,
                              today, write_result)
from track_1_short import config as config_mod
from track_1_short import report
from track_1_short.data import (BOS_ID, HEADER_BYTES, DataError, SliceShape, TrainStream, list_shards,
                                num_val_slices, read_header)

RECORD_MICRO_STEPS = 8  # the harness runs at world size 1: grad_accum_steps 8
PARITY_MARGIN = 0.02  # the criterion: ours <= the record's + this at every validation before the repeat
# config.json keys that name a run or add a diagnostic without changing its training (pool)
OURS_RUN_KEYS = ("train.run_id", "train.runs_dir", "train.update_norm_steps")
RECORD_RUN_KEYS = ("out_dir", "cmdline")  # the harness's run.config keys of the same kind
UNBOUNDED_ROWS = 1 << 30  # cu_seqlens capacity for walking the stream (no key is built)


@dataclass(slots=True, frozen=True)
class StageShape:
    """One stage as both loaders see it: its steps and one micro-batch's tokens and document cut."""

    name: str
    num_steps: int
    tokens: int  # T per micro-batch (per rank)
    max_seq_len: int


def stage_shapes(stages: list[dict]) -> list[StageShape]:
    return [StageShape(s["name"], s["num_steps"], s["tokens_per_rank"], s["max_seq_len"]) for s in stages]


def boundaries(shapes: list[StageShape]) -> list[list[int]]:
    out, start = [], 0
    for s in shapes:
        out.append([start, start + s.num_steps])
        start += s.num_steps
    return out


def per_step(shapes: list[StageShape]) -> list[StageShape]:
    return [s for s in shapes for _ in range(s.num_steps)]


# ---------------------------------------------------------------- first repeat

def ours_first_repeat(train_shards: list[Path], seed: int, shuffle: bool, steps: list[StageShape],
                      slices_per_step: int) -> int | None:
    """The first step that takes a document of the stream's second epoch (None: none does)."""
    stream = TrainStream(train_shards, seed=seed, shuffle=shuffle)
    for step, s in enumerate(steps):
        shape = SliceShape(tokens=s.tokens, max_seq_len=s.max_seq_len, cu_seqlens_rows=UNBOUNDED_ROWS)
        for _ in range(slices_per_step):
            stream.next_slice(shape)
            pos = stream.pos  # (1, 0, 0) right after the first epoch's last document: no repeat yet
            if pos.epoch > 1 or (pos.epoch == 1 and (pos.shard_pos or pos.doc_pos)):
                return step
    return None


def bos_index(path: Path) -> tuple[np.ndarray, int]:
    """(BOS positions, token count) of one shard."""
    count = read_header(path)
    tokens = np.memmap(path, dtype=np.uint16, mode="r", offset=HEADER_BYTES, shape=(count,))
    return np.flatnonzero(tokens == BOS_ID), count


def record_micro_batches(train_shards: list[Path], steps: list[StageShape],
                         micro_steps: int = RECORD_MICRO_STEPS):
    """Upstream's loader (Shard.next_batch, world size 1, files in sorted order) walked over the
    schedule: yields (step, shard path, [(start, end) token spans of the micro-batch's T + 1
    tokens]) per micro-batch, then (step, None, None) at the first step that runs out of BOS in
    the last train shard (the harness would then reload the cycled files: repeated data)."""
    files = iter(train_shards)
    path = next(files)
    bos, size = bos_index(path)
    idx = 0
    for step, s in enumerate(steps):
        for _ in range(micro_steps):
            while True:  # a micro-batch that hits the shard's tail is redone on the next shard
                cur_len, i, spans = 0, idx, []
                while cur_len <= s.tokens and i < bos.size:
                    cur = int(bos[i])
                    i += 1
                    end = min(int(bos[i]) if i < bos.size else size, cur + s.max_seq_len,
                              cur + s.tokens - cur_len + 1)
                    spans.append((cur, end))
                    cur_len += end - cur
                if cur_len > s.tokens:
                    idx = i
                    yield step, path, spans
                    break
                path = next(files, None)
                if path is None:
                    yield step, None, None
                    return
                (bos, size), idx = bos_index(path), 0


def record_first_repeat(train_shards: list[Path], steps: list[StageShape],
                        micro_steps: int = RECORD_MICRO_STEPS) -> int | None:
    """The first step at which upstream's loader runs out of BOS in the last train shard (None:
    it never does); record_micro_batches."""
    for step, path, _ in record_micro_batches(train_shards, steps, micro_steps):
        if path is None:
            return step
    return None


def first_stream_difference(train_shards: list[Path], shuffle: bool, steps: list[StageShape],
                            slices_per_step: int) -> int | None:
    """The first step whose micro-batches hold other tokens in our TrainStream than in upstream's
    loader (None: the same tokens at every step before either runs out of data or the schedule
    ends). 0 when our documents come in a seeded order (shuffle) or the two take a different
    number of micro-batches per step; equal streams need file order (data.shuffle false)."""
    if shuffle or slices_per_step != RECORD_MICRO_STEPS:
        return 0
    stream = TrainStream(train_shards, shuffle=False)
    tokens = {}  # shard path -> memmap of its tokens
    for step, path, spans in record_micro_batches(train_shards, steps):
        if path is None:
            return None
        s = steps[step]
        rows = s.tokens + 2  # room for T + 1 one-token documents: never the limit
        shape = SliceShape(tokens=s.tokens, max_seq_len=s.max_seq_len, cu_seqlens_rows=rows)
        ours = np.empty(s.tokens + 1, dtype=np.int32)  # [T + 1]
        stream.next_slice(shape, ours, np.empty(rows, dtype=np.int32))
        if path not in tokens:
            tokens[path] = np.memmap(path, dtype=np.uint16, mode="r", offset=HEADER_BYTES,
                                     shape=(read_header(path),))
        record = np.concatenate([tokens[path][a:b] for a, b in spans])
        if not np.array_equal(ours, record):
            return step
    return None


def token_count_bound(steps: list[StageShape], slices_per_step: int, corpus_tokens: int) -> int | None:
    """The first step at which the tokens trained so far exceed the corpus."""
    total = 0
    for step, s in enumerate(steps):
        total += slices_per_step * s.tokens
        if total > corpus_tokens:
            return step
    return None


# ---------------------------------------------------------------- inputs

def corpus(data_dir: Path) -> tuple[list[Path], list[Path], int, int]:
    """(train shards, val shards, train tokens, val tokens) of a data dir."""
    try:
        train, val = list_shards(data_dir, "train"), list_shards(data_dir, "val")
        return train, val, sum(map(read_header, train)), sum(map(read_header, val))
    except DataError as e:
        raise InputError(f"--data-dir: {e}") from None


def load_ours(run_dir: Path) -> tuple[dict, list[dict], dict[int, float], dict | None]:
    """(config.json, val records of metrics.jsonl, its train objective by step, summary.json or
    None) of a trainer run dir."""
    run_dir = Path(run_dir)
    hint = "pass the run dir of `python -m track_1_short.train` (RUNS_DIR/RUN_ID)"
    cfg = load_json(run_dir / "config.json", "a trainer run dir's config.json", hint)
    if "schedule" not in cfg or "data" not in cfg:
        raise InputError(f"{run_dir / 'config.json'}: not a trainer config (no schedule / data); {hint}")
    if not (run_dir / "metrics.jsonl").is_file():
        raise InputError(f"{run_dir / 'metrics.jsonl'} does not exist: the run stopped before its "
                         f"first log line; see its train.log")
    records = report.MetricsLog.read(run_dir)
    val = [r for r in records if r.get("kind") == "val"]
    if not val:
        raise InputError(f"{run_dir / 'metrics.jsonl'} has no validation record: the run stopped "
                         "before its first validation, or ran with validation off")
    train = {r["step"]: r["loss"] for r in records if r.get("kind") == "train"}
    summary = run_dir / "summary.json"
    return cfg, val, train, json.loads(summary.read_text()) if summary.is_file() else None


def load_record(path: Path) -> tuple[dict, dict, Path]:
    """(val curve, loss.json, its path) of the harness's `run.sh loss` output (loss.jsonl or its
    folder; a renamed copy NAME.jsonl reads NAME.json beside it, e.g. a committed record curve)."""
    try:
        curve = report.read_record_val_curve(path)
    except ValueError as e:
        raise InputError(f"--record: {e}") from None
    source = Path(curve["source"])  # loss.jsonl, or a copy such as record_loss.jsonl
    loss_json = source.with_suffix(".json")
    if not loss_json.is_file():
        loss_json = source.with_name("loss.json")
    summary = load_json(loss_json, "the harness's loss.json beside its loss.jsonl",
                        "the harness writes it next to loss.jsonl, also when the run is cut")
    if summary.get("mode") != "loss":
        raise InputError(f"{loss_json}: mode {summary.get('mode')!r}, not a `run.sh loss` summary")
    return curve, summary, loss_json


def record_train_losses(loss_jsonl: Path) -> dict[int, float]:
    """0-based step -> train objective of the harness's loss.jsonl (`step: k` is step k-1 done)."""
    out = {}
    for line in loss_jsonl.read_text().splitlines():
        r = json.loads(line) if line.strip() else {}
        if r.get("kind") == "train":
            out[r["step"] - 1] = r["train_loss"]
    return out


TRANSITION_WINDOW = 5  # steps on each side of a stage boundary


def transition(losses: dict[int, float], b: int, window: int = TRANSITION_WINDOW) -> dict | None:
    """The train objective around boundary step b (module docstring), None without every step."""
    steps = range(b - window, b + window)
    if not all(s in losses for s in steps):
        return None
    before = float(np.mean([losses[s] for s in range(b - window, b)]))
    after = [losses[s] for s in range(b, b + window)]
    recovered = next((s for s in sorted(losses) if s >= b and losses[s] <= before), None)
    return {"before": before, "after": after, "jump": max(after) - before, "recovered_at": recovered}


def transitions(ours: dict[int, float], record: dict[int, float], bounds: list[list[int]],
                repeat_at: int | None) -> list[dict]:
    out = []
    for start, _ in bounds[1:]:
        if repeat_at is not None and start + TRANSITION_WINDOW > repeat_at:
            break
        out.append({"step": start, "ours": transition(ours, start), "record": transition(record, start)})
    return out


def train_gap(ours: dict[int, float], record: dict[int, float], bounds: list[list[int]],
              names: list[str], until: int | None) -> list[dict] | None:
    """The module docstring's train_gap: steps < until (None: every step) both sides logged."""
    if until == 0:
        return None
    out = []
    for name, (start, end) in zip(names, bounds):
        steps = [s for s in range(start, end if until is None else min(end, until))
                 if s in ours and s in record]
        if not steps:
            continue
        gaps = np.array([ours[s] - record[s] for s in steps])
        worst = int(np.argmax(gaps))
        out.append({"stage": name, "steps": [steps[0], steps[-1] + 1], "mean": float(gaps.mean()),
                    "sd": float(gaps.std()), "max": float(gaps[worst]), "max_step": steps[worst]})
    return out


def same(what: str, ours, ours_src: str, record, record_src: str) -> None:
    if ours != record:
        raise InputError(f"not the same {what}: ours {ours!r} ({ours_src}), the record's {record!r} "
                         f"({record_src}); re-run scripts/gpu/loss_parity.sh, whose settings match")


# ---------------------------------------------------------------- build

def earliest(*steps: int | None) -> int | None:
    """The first of the given steps that come (None ones never do), None if none comes: e.g. the
    first repeat of either loader, or the first step whose batches differ between the sides."""
    found = [s for s in steps if s is not None]
    return min(found) if found else None


def largest_excess(gap_by_step: dict[int, float]) -> dict | None:
    """{gap, step}: the largest signed gap (the first step of equal ones); None for no step."""
    step = max(gap_by_step, key=gap_by_step.get, default=None)
    return None if step is None else {"gap": gap_by_step[step], "step": step}


def build(ours_dir: Path, record_path: Path, data_dir: Path, corpus_name: str, script: str | None) -> dict:
    cfg, ours_val, ours_train, summary = load_ours(ours_dir)
    record_curve, rec, loss_json = load_record(record_path)
    train, val_shards, train_tokens, val_tokens = corpus(data_dir)
    src_ours, src_rec = str(Path(ours_dir) / "config.json"), str(loss_json)
    shapes = stage_shapes(cfg["schedule"]["stages"])
    same("train corpus (tokens)", train_tokens, f"--data-dir {data_dir}",
         (rec.get("train_data") or {}).get("tokens"), src_rec)
    same("stage boundaries", boundaries(shapes), src_ours, (rec.get("schedule") or {}).get("boundaries"), src_rec)
    T = cfg["data"]["val_tokens_per_batch"]
    ours_val_tokens = num_val_slices(min(val_tokens, cfg["data"]["val_tokens"]), T) * T
    rec_val = rec.get("val") or {}
    same("validation shards", sorted(p.name for p in val_shards), f"--data-dir {data_dir}",
         sorted(Path(f).name for f in rec_val.get("files") or []), src_rec)
    same("validation tokens per forward", T, src_ours, rec_val.get("tokens_per_forward"), src_rec)
    same("validation token count", ours_val_tokens, src_ours, rec_val.get("tokens"), src_rec)

    micro = cfg["data"].get("micro_steps")
    world = (summary or {}).get("world_size", 1)
    slices = cfg["data"]["slices_per_step"] if micro is None else micro * world
    steps = per_step(shapes)
    streams_differ_at = first_stream_difference(train, cfg["data"]["shuffle"], steps, slices)
    repeats = {"ours": ours_first_repeat(train, cfg["data"]["seed"], cfg["data"]["shuffle"], steps, slices),
               "record": record_first_repeat(train, steps),
               "token_count_bound": token_count_bound(steps, slices, train_tokens)}
    repeat_at = earliest(repeats["ours"], repeats["record"])

    ours_by_step = {r["step"]: r["val_loss"] for r in ours_val}  # a resumed run: its last value
    rec_by_step = {r["step"]: r["val_loss"] for r in record_curve["val_curve"]}
    points = [{"step": s, "ours": ours_by_step[s], "record": rec_by_step[s]}
              for s in sorted(set(ours_by_step) & set(rec_by_step))]
    before = [p for p in points if repeat_at is None or p["step"] <= repeat_at]
    worst = max(before, key=lambda p: abs(p["ours"] - p["record"]), default=None)
    record_train = record_train_losses(Path(record_curve["source"]))
    return {"command": {"script": script, "builder": builder_command(),
                        "record": (rec.get("run") or {}).get("command")},
            "corpus": corpus_name, "corpus_tokens": train_tokens,
            "val_tokens": ours_val_tokens, "val_tokens_per_forward": T,
            "record_val_backend": rec_val.get("backend"),
            "boundaries": boundaries(shapes),
            # "next": ours validated a stage's first step in the new stage's windows, as the
            # record does; "trained": in the windows trained so far (those points differ in kind)
            "stage_start_validation": cfg["schedule"].get("stage_start_validation", "trained"),
            "repeats_at_step": repeat_at, "repeats": repeats,
            "streams_differ_at_step": streams_differ_at,
            "val": points,
            "max_gap_before_repeat": worst["ours"] - worst["record"] if worst else None,
            "max_gap_step": worst["step"] if worst else None,
            "max_excess_before_repeat": largest_excess({p["step"]: p["ours"] - p["record"] for p in before}),
            "transitions": transitions(ours_train, record_train, boundaries(shapes), repeat_at),
            "train_gap": train_gap(ours_train, record_train, boundaries(shapes),
                                   [s.name for s in shapes], earliest(repeat_at, streams_differ_at)),
            "complete": {"ours": summary is not None, "record": rec.get("status") == "complete"}}


# ---------------------------------------------------------------- pool

def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def same_configuration(what: str, configs: list[tuple[str, dict]], ignore: tuple[str, ...]) -> None:
    """InputError naming the first key in which a run's configuration differs from the first's."""
    (first_src, first), *rest = [(src, _flat(c)) for src, c in configs]
    for src, cfg in rest:
        for key in sorted(set(first) | set(cfg)):
            if key not in ignore and first.get(key) != cfg.get(key):
                raise InputError(f"{what} runs to pool differ in {key}: {first.get(key)!r} ({first_src}) "
                                 f"vs {cfg.get(key)!r} ({src}); pool only repeats of one configuration")


def run_to_run_sd(runs: list[dict[int, float]], steps: list[int]) -> float | None:
    """The pooled sd of one side's runs about their per-step mean over steps (module docstring);
    None for one run or no step."""
    if len(runs) < 2 or not steps:
        return None
    x = np.array([[r[s] for s in steps] for r in runs])  # [runs, steps]
    return float(np.sqrt(((x - x.mean(0)) ** 2).sum() / (len(steps) * (len(runs) - 1))))


def point_se(ours: list[float], record: list[float]) -> float | None:
    """The standard error of one point's gap of means, from that point's own sample variances
    (ddof 1): sqrt(var_ours / n_ours + var_record / n_record); None with a side of one run."""
    if len(ours) < 2 or len(record) < 2:
        return None
    return float(np.sqrt(np.var(ours, ddof=1) / len(ours) + np.var(record, ddof=1) / len(record)))


def self_excess(runs: list[dict[int, float]], steps: list[int]) -> list[dict] | None:
    """Per run, {gap, step}: the largest excess of that run over the mean of the same side's other
    runs at the given steps (the parity criterion applied to one run of a trainer against itself,
    which shows how often a single run misses it by noise alone); None for one run or no step."""
    if len(runs) < 2 or not steps:
        return None
    out = []
    for i, run in enumerate(runs):
        others = [r for j, r in enumerate(runs) if j != i]
        out.append(largest_excess({s: run[s] - float(np.mean([r[s] for r in others])) for s in steps}))
    return out


def mean_jump(jumps: list[float | None]) -> float | None:
    """The mean of the runs' transition jumps that were measured (None entries left out)."""
    known = [j for j in jumps if j is not None]
    return float(np.mean(known)) if known else None


def mean_curve(runs: list[dict[int, float]]) -> dict[int, float]:
    """step -> the mean over runs, at the steps every run has."""
    common = set.intersection(*(set(r) for r in runs))
    return {s: float(np.mean([r[s] for r in runs])) for s in sorted(common)}


def largest_spread(runs: list[dict[int, float]], until: int | None) -> dict | None:
    """{step, spread}: the largest max - min over runs at one step < until; None for one run."""
    steps = [s for s in mean_curve(runs) if until is None or s < until]
    if len(runs) < 2 or not steps:
        return None
    spread = {s: max(r[s] for r in runs) - min(r[s] for r in runs) for s in steps}
    worst = max(spread, key=spread.get)
    return {"step": worst, "spread": spread[worst]}


def pool(ours_dirs: list[Path], record_paths: list[Path], data_dir: Path, corpus_name: str,
         script: str | None) -> dict:
    # every run against the other side's first, as build checks a pair (corpus, schedule, val set)
    pairs = ([build(o, record_paths[0], data_dir, corpus_name, script) for o in ours_dirs]
             + [build(ours_dirs[0], r, data_dir, corpus_name, script) for r in record_paths[1:]])
    ours = [load_ours(o) for o in ours_dirs]
    records = [load_record(r) for r in record_paths]
    same_configuration("our", [(str(Path(o) / "config.json"), run[0]) for o, run in zip(ours_dirs, ours)],
                       OURS_RUN_KEYS)
    same_configuration("the record's", [(str(path), {"upstream": summary.get("upstream"),
                                                     "config": (summary.get("run") or {}).get("config") or {}})
                                        for _, summary, path in records],
                       tuple(f"config.{k}" for k in RECORD_RUN_KEYS))
    repeat_at, differ_at = pairs[0]["repeats_at_step"], pairs[0]["streams_differ_at_step"]
    ours_val = [{r["step"]: r["val_loss"] for r in run[1]} for run in ours]
    rec_val = [{r["step"]: r["val_loss"] for r in curve["val_curve"]} for curve, _, _ in records]
    o_mean, r_mean = mean_curve(ours_val), mean_curve(rec_val)
    steps = sorted(set(o_mean) & set(r_mean))
    before = [s for s in steps if repeat_at is None or s <= repeat_at]
    sd = {"ours": run_to_run_sd(ours_val, before), "record": run_to_run_sd(rec_val, before)}
    se = (float(np.sqrt(sd["ours"] ** 2 / len(ours) + sd["record"] ** 2 / len(records)))
          if None not in sd.values() else None)
    val = [{"step": s, "ours": o_mean[s], "record": r_mean[s], "gap": o_mean[s] - r_mean[s],
            "se": point_se([v[s] for v in ours_val], [v[s] for v in rec_val]),
            "ours_runs": [v[s] for v in ours_val], "record_runs": [v[s] for v in rec_val]} for s in steps]
    gaps = {p["step"]: p["gap"] for p in val if p["step"] in before}

    shapes = stage_shapes(ours[0][0]["schedule"]["stages"])
    bounds, names = boundaries(shapes), [s.name for s in shapes]
    o_train = [run[2] for run in ours]
    r_train = [record_train_losses(Path(curve["source"])) for curve, _, _ in records]
    until = earliest(repeat_at, differ_at)

    def train_sd(runs: list[dict[int, float]]) -> list[dict] | None:
        common = mean_curve(runs)
        out = []
        for name, (start, end) in zip(names, bounds):
            stage_steps = [s for s in range(start, end if until is None else min(end, until)) if s in common]
            value = run_to_run_sd(runs, stage_steps)
            if value is not None:
                out.append({"stage": name, "steps": [stage_steps[0], stage_steps[-1] + 1], "sd": value})
        return out or None

    trans = []
    for b, _ in bounds[1:]:
        if repeat_at is None or b + TRANSITION_WINDOW <= repeat_at:
            jumps = {side: [(transition(r, b) or {}).get("jump") for r in runs]
                     for side, runs in (("ours", o_train), ("record", r_train))}
            trans.append({"step": b, **jumps, "mean": {side: mean_jump(j) for side, j in jumps.items()}})
    return {"command": {"script": script, "builder": builder_command()}, "corpus": corpus_name,
            "runs": {"ours": [str(o) for o in ours_dirs], "record": [str(r) for r in record_paths]},
            "n": {"ours": len(ours), "record": len(records)},
            "repeats_at_step": repeat_at, "streams_differ_at_step": differ_at,
            "val": val,
            "run_to_run_sd": {"val": sd, "train": {"ours": train_sd(o_train), "record": train_sd(r_train)}},
            "gap_se": se,
            "max_excess_before_repeat": largest_excess(gaps),
            "over_margin_before_repeat": [s for s in before if gaps[s] > PARITY_MARGIN],
            "self_excess_before_repeat": {"ours": self_excess(ours_val, before),
                                          "record": self_excess(rec_val, before)},
            "train_gap": (train_gap(mean_curve(o_train), mean_curve(r_train), bounds, names, until)
                          if until != 0 else None),
            "train_spread": {"ours": largest_spread(o_train, until), "record": largest_spread(r_train, until)},
            "transitions": trans}


# ---------------------------------------------------------------- anchor-args

def anchor_args(preset: str, data_dir: Path, val_every: int, val_tokens_per_batch: int | None,
                max_val_tokens: int | None) -> str:
    """run.sh KEY=VALUE settings that give the record our preset's schedule and validation."""
    cfg = config_mod.preset(preset)
    stages, sched = cfg.schedule.stages, cfg.schedule
    main = [s.num_steps for s in stages if not s.extension]
    ext = [s.num_steps for s in stages if s.extension]
    iters = sum(main)
    thirds = [round(iters / 3), round(2 * iters / 3) - round(iters / 3), iters - round(2 * iters / 3)]
    if len(main) != 3 or main != thirds or len(ext) != 1:
        raise InputError(f"--preset {preset}: stages {[(s.name, s.num_steps) for s in stages]}; the "
                         f"record splits ITERS into thirds plus one extension stage (here {thirds} + 1)")
    _, val_shards, _, val_tokens = corpus(data_dir)
    T = val_tokens_per_batch or cfg.data.val_tokens_per_batch
    available = min(val_tokens, max_val_tokens or cfg.data.val_tokens)
    # ours: (N - 1) // T slices; the harness's loader also wants a token beyond the last target
    slices = min(num_val_slices(available, T), num_val_slices(val_tokens - 1, T))
    if slices < 1:
        raise InputError(f"--data-dir {data_dir}: {val_tokens} validation tokens hold no batch of {T}")
    return " ".join(f"{k}={v}" for k, v in (
        ("ITERS", iters), ("EXT_ITERS", ext[0]), ("MUON_WARMUP", sched.momentum_warmup_steps),
        ("MUON_COOLDOWN", sched.momentum_cooldown_steps), ("VAL_EVERY", val_every),
        ("VAL_SEQ", T), ("VAL_TOKENS", slices * T)))


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/loss_parity.py", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="the loss-parity JSON from our run dir and the record's loss.jsonl")
    b.add_argument("--ours", type=Path, required=True, metavar="RUN_DIR", help="our trainer's run dir")
    b.add_argument("--record", type=Path, required=True, metavar="LOSS_JSONL",
                   help="the harness's loss.jsonl (run.sh loss), or its OUT_DIR")
    b.add_argument("--data-dir", type=Path, required=True, help="the shards both runs trained on")
    b.add_argument("--corpus", default=None, help="corpus name for the file name (default: the data dir's)")
    b.add_argument("--variant", default=None,
                   help="our run's variant (an ablation's name): in the file name, "
                        "loss_parity_<corpus>_<variant>_<date>.json, and as `variant`")
    add_output_args(b)
    q = sub.add_parser("pool", help="the pooled loss-parity JSON from several runs of each side")
    q.add_argument("--ours", type=Path, action="append", required=True, metavar="RUN_DIR",
                   help="one of our run dirs (repeat the flag per run)")
    q.add_argument("--record", type=Path, action="append", required=True, metavar="LOSS_JSONL",
                   help="one of the harness's loss.jsonl or OUT_DIR (repeat the flag per run)")
    q.add_argument("--data-dir", type=Path, required=True, help="the shards every run trained on")
    q.add_argument("--corpus", default=None, help="corpus name for the file name (default: the data dir's)")
    q.add_argument("--variant", default=None, help="our runs' variant, in the file name and as `variant`")
    add_output_args(q)
    a = sub.add_parser("anchor-args", help="run.sh KEY=VALUE settings matching a preset")
    a.add_argument("--preset", default="small-gpu", choices=config_mod.PRESETS)
    a.add_argument("--data-dir", type=Path, required=True)
    a.add_argument("--val-every", type=int, required=True)
    a.add_argument("--val-tokens-per-batch", type=int, default=None)
    a.add_argument("--val-tokens", type=int, default=None, help="at most this many (default the preset's)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.command == "anchor-args":
        print(anchor_args(args.preset, args.data_dir, args.val_every, args.val_tokens_per_batch,
                          args.val_tokens))
        return 0
    name = args.corpus or args.data_dir.resolve().name
    stem = f"loss_parity_{name}" + (f"_{args.variant}" if args.variant else "")
    if args.command == "pool":
        result = pool(args.ours, args.record, args.data_dir, name, args.script)
        if args.variant:
            result["variant"] = args.variant
        write_result(args.out_dir, f"{stem}_pooled_{args.date or today()}.json", result)
        excess, sd = result["max_excess_before_repeat"] or {}, result["run_to_run_sd"]["val"]
        print(f"{result['n']} runs; run-to-run val sd ours {sd['ours']} record {sd['record']}, gap se "
              f"{result['gap_se']}; largest mean excess {excess.get('gap')} at step {excess.get('step')}; "
              f"over +{PARITY_MARGIN} at {result['over_margin_before_repeat']}")
        return 0
    result = build(args.ours, args.record, args.data_dir, name, args.script)
    if args.variant:
        result["variant"] = args.variant
    write_result(args.out_dir, f"{stem}_{args.date or today()}.json", result)
    excess = result["max_excess_before_repeat"] or {}
    print(f"repeats at step {result['repeats_at_step']} ({result['repeats']}); max gap before it "
          f"{result['max_gap_before_repeat']} at step {result['max_gap_step']}; largest excess "
          f"{excess.get('gap')} at step {excess.get('step')}")
    for g in result["train_gap"] or []:
        print(f"train objective, ours - record, stage {g['stage']} steps {g['steps']}: mean "
              f"{g['mean']:+.4f} (sd {g['sd']:.4f}), max {g['max']:+.4f} at step {g['max_step']}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main("bench/loss_parity.py", main, None))
