"""Per-step metrics: a JSONL file (always), TensorBoard and W&B (optional), timers, a progress line.

``run_dir/metrics.jsonl`` is the record of a run: one JSON object per logged step, ``{"step": N,
"time": unix seconds, "<group>/<name>": value, ...}``, appended and flushed on every write so that
a crash loses at most the step being written. Values that are not finite (NaN, inf) are written
as null, because JSON has no NaN and strict parsers (jq, JavaScript) reject it.

Resume: the logger is told the first step it will log (``start_step``). Lines with a step at or
beyond it are dropped from metrics.jsonl when it opens (they belong to steps that will run
again), and TensorBoard is opened with ``purge_step`` for the same reason. A fresh run passes 0,
which empties the file. W&B resumes the run whose id is kept in ``run_dir/wandb_id.txt``.

Host syncs: metric values may be 0-d tensors (loss metrics are kept on device without
``.item()``, style rule 7). ``log`` stacks all of them and copies them to the host once per
device, so a step costs one sync, not one per metric.

Only rank 0 should write: build the logger everywhere with ``enabled=(rank == 0)``. Disabled,
it writes nothing and opens nothing, but timers and ``log`` still run so that every rank takes
the same code path (``log`` still syncs its tensors; call it only with already-reduced metrics).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
WANDB_ID_FILE = "wandb_id.txt"

# (metric key, short label) pairs for the console line; keys absent from a step are skipped. The
# held-out accuracy's key names eval.n (progress_keys).
PROGRESS_KEYS: tuple[tuple[str, str], ...] = (
    ("reward/acc_mean", "acc"),
    ("reward/score_mean", "reward"),
    ("response_length/mean", "len"),
    ("actor/entropy", "ent"),
    ("actor/pg_clipfrac_high", "clip_hi"),
    ("dynamic_sampling/num_gen_batches", "gen"),
    # mean exp|engine - trainer log-prob|: 1 when the two agree, so it must not read as a share
    ("rollout/logprob_mismatch", "eng/trn"),
    ("rollout_corr/is_frac_high", "is_high"),  # only with algorithm.rollout_correction.rollout_is
    ("timing_s/step", "s"),
)


class MetricsLogger:
    """Writes one record per step to metrics.jsonl, TensorBoard and W&B.

    Args:
        run_dir: directory of the run (created).
        tensorboard: also write TensorBoard events into ``run_dir/tensorboard``.
        wandb: also log to Weights & Biases; if it is not installed, a warning and no W&B.
        wandb_project: the W&B project.
        config: the resolved run configuration (a plain dict); stored as TensorBoard text and as
            the W&B run config.
        enabled: False on every rank but rank 0 (see the module docstring).
        start_step: the first step this run will log; records at or after it are dropped.
    """

    def __init__(self, run_dir: str | Path, *, tensorboard: bool, wandb: bool, wandb_project: str,
                 config: Mapping[str, Any], enabled: bool, start_step: int):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self._timings: dict[str, float] = defaultdict(float)
        self._file = None
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        num_dropped = truncate_from_step(self.path, start_step)
        if num_dropped:
            logger.info("Dropped %d records at step >= %d from %s (resumed run)", num_dropped, start_step,
                        self.path)
        self._file = self.path.open("a", encoding="utf-8")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=start_step)
            config_text = json.dumps(config, indent=2, default=str)
            self._tb.add_text("config", "```\n" + config_text + "\n```", start_step)
        if wandb:
            self._wandb = _init_wandb(self.run_dir, wandb_project, config, resume=start_step > 0)

    @contextlib.contextmanager
    def timer(self, name: str) -> Iterator[None]:
        """Adds the wall time of the block to ``timing_s/<name>`` of the current step (sums repeats).

        The block is also a ``phase_range(name)``, so a profiler trace (observe/profiler.py) or an
        nsys timeline shows the same phases the timings name."""
        start = time.perf_counter()
        try:
            with phase_range(name):
                yield
        finally:
            self._timings[name] += time.perf_counter() - start

    def log(self, step: int, metrics: Mapping[str, float | int | torch.Tensor]) -> dict[str, float]:
        """Records ``metrics`` and this step's timers under ``step``; returns the values as floats.

        Timers are reset afterwards, so each record holds the time spent in that step only.
        """
        values = to_floats(metrics)
        values.update({f"timing_s/{k}": v for k, v in self._timings.items()})
        self._timings.clear()
        if not self.enabled:
            return values
        record = {"step": int(step), "time": round(time.time(), 3)}
        record.update({k: (v if math.isfinite(v) else None) for k, v in values.items()})
        self._file.write(json.dumps(record, ensure_ascii=True) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(values, step=step)
        return values

    def log_samples(self, step: int, phase: str, rows: Sequence[Mapping[str, Any]]) -> None:
        """Dump rows (observe/rows.py) as a TensorBoard text table and a W&B table, when those are on."""
        if not self.enabled or not rows:
            return
        columns = ("prompt_index", "response_index", "acc", "audit_acc", "pred", "ground_truth", "advantage",
                   "kept", "flags", "response")
        if self._tb is not None:
            lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            lines += ["| " + " | ".join(_cell(r.get(c)) for c in columns) + " |" for r in rows]
            self._tb.add_text(f"samples/{phase}", "\n".join(lines), step)
            self._tb.flush()
        if self._wandb is not None:
            import wandb

            table = wandb.Table(columns=list(columns), data=[[str(r.get(c)) for c in columns] for r in rows])
            self._wandb.log({f"samples/{phase}": table}, step=step)

    def log_histogram(self, step: int, name: str, values: Sequence[float]) -> None:
        """A distribution (e.g. the ledger's pass rates) as a TensorBoard histogram, when it is on."""
        if self.enabled and self._tb is not None and values:
            self._tb.add_histogram(name, torch.tensor(list(values)), step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@functools.cache
def _on_cuda() -> bool:
    """Asked once: phase_range runs many times per step and the answer does not change."""
    return torch.cuda.is_available()


@contextlib.contextmanager
def phase_range(name: str) -> Iterator[None]:
    """The block as a range named ``name`` in a torch profiler trace (observe/profiler.py) and, on
    CUDA, in an nsys timeline (NVTX). Without a profiler running it costs microseconds, so it can
    stay on in every run. Lives here, not in observe/, so that this module imports no subpackage."""
    with torch.profiler.record_function(name):
        if not _on_cuda():
            yield
            return
        torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            torch.cuda.nvtx.range_pop()


def _cell(value: Any) -> str:
    """A markdown table cell: no column bars, no line breaks."""
    return str(value).replace("|", "\\|").replace("\n", " / ")


def to_floats(metrics: Mapping[str, float | int | torch.Tensor]) -> dict[str, float]:
    """Python floats of numbers and 0-d (or one-element) tensors, one host copy per device."""
    out: dict[str, float] = {}
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = defaultdict(list)
    for key, value in metrics.items():
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"metric {key!r} must be a scalar, got shape {tuple(value.shape)}")
            by_device[value.device].append((key, value))
        else:
            out[key] = float(value)
    for items in by_device.values():
        stacked = torch.stack([v.detach().reshape(()).to(torch.float64) for _, v in items])
        for (key, _), value in zip(items, stacked.cpu().tolist()):
            out[key] = value
    return {key: out[key] for key in metrics}  # caller's order


def truncate_from_step(path: Path, start_step: int) -> int:
    """Rewrites ``path`` without records whose step is >= ``start_step``; returns how many went.

    A last line cut short by a crash is dropped too. The file is rewritten through a temporary
    file and a rename, so a crash here cannot lose the earlier records.
    """
    if not path.exists():
        return 0
    kept, num_dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            num_dropped += 1
            continue
        if step >= start_step:
            num_dropped += 1
        else:
            kept.append(line)
    if num_dropped:
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        tmp.replace(path)
    return num_dropped


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file (a line cut short by a crash is skipped)."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(ValueError):
            records.append(json.loads(line))
    return records


def progress_keys(eval_n: int) -> tuple[tuple[str, str], ...]:
    """The console line's keys for a run evaluating ``eval_n`` samples per problem."""
    return ((f"eval/avg@{eval_n}", "eval_acc"), *PROGRESS_KEYS)


def format_progress(step: int, values: Mapping[str, float], *, total_steps: int,
                    keys: Sequence[tuple[str, str]] = PROGRESS_KEYS) -> str:
    """One compact console line, e.g. ``step   12/300 | acc 0.531 | len 5.12 | s 1.43``."""
    width = len(str(total_steps))
    parts = [f"step {step:>{width}}/{total_steps}"]
    for key, label in keys:
        if key in values:
            parts.append(f"{label} {_short(values[key])}")
    return " | ".join(parts)


def _short(value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    if value == int(value) and abs(value) < 1e6:
        return str(int(value))
    return f"{value:.3g}" if abs(value) < 1e-2 or abs(value) >= 1e3 else f"{value:.3f}"


def _init_wandb(run_dir: Path, project: str, config: Mapping[str, Any], *, resume: bool):
    try:
        import wandb
    except ImportError:
        logger.warning("logging.wandb=true but wandb is not installed; logging to metrics.jsonl "
                       "(and TensorBoard, if enabled) only. Install it with: pip install wandb")
        return None
    id_file = run_dir / WANDB_ID_FILE
    # Our own id: wandb.util.generate_id is gone from wandb 0.31 (logging.wandb=true failed there).
    run_id = id_file.read_text().strip() if resume and id_file.exists() else uuid.uuid4().hex[:8]
    id_file.write_text(run_id + "\n")
    return wandb.init(project=project, id=run_id, resume="allow", dir=str(run_dir), config=dict(config),
                      name=run_dir.name)
