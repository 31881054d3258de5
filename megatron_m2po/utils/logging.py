"""Metrics sinks, the training progress display, and the process-wide logging setup.

- :class:`MetricsLogger` writes every ``log(metrics, step)`` call as one JSON line to
  ``<run_dir>/metrics.jsonl`` (appended on resume; :func:`read_metrics` keeps the last record
  of a step that was logged twice around a crash), to TensorBoard (``<run_dir>/tensorboard``),
  and to Weights & Biases when a project is configured (imported lazily; the run id is kept in
  ``<run_dir>/wandb_run_id`` so a resumed run continues the same W&B run).
- :class:`TrainProgress` shows step, reward, accuracy, mask / clip fraction, staleness and
  throughput: a live rich bar on a terminal, plain log lines otherwise (CI, files, pipes).
- :func:`setup_logging` prefixes every line with the rank; ranks other than 0 log warnings only.

Metric values: numbers (Python, numpy or 0-d tensors) are scalars; non-finite numbers are
written as ``null`` in JSONL (strict JSON) and skipped in TensorBoard. A list / array value is a
histogram: under a key ending in ``/hist`` it holds *counts* of the integer bins 0, 1, 2, ...
(e.g. ``staleness/hist[k]`` = tokens with staleness k); under any other key it holds raw samples.
Strings are kept in JSONL only.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np

log = logging.getLogger("megatron_m2po")

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"
TB_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_run_id"


# --------------------------------------------------------------------------------------------
# Value normalisation


def _to_python(value: Any) -> Any:
    """float / int / list / str, or None for a non-finite number."""
    if hasattr(value, "detach"):  # torch tensor, without importing torch here
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        value = value.item() if value.ndim == 0 else value.tolist()
    elif isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (int, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_to_python(v) for v in value]
    raise ValueError(f"metric value of type {type(value).__name__} is not loggable: {value!r}; "
                     f"log numbers, lists of numbers (histograms) or strings")


def moving_average(ys: list[float], window: int) -> list[float]:
    """Trailing mean over ``window`` points (shorter at the start); ``window <= 1`` returns ``ys``."""
    if window <= 1 or len(ys) < 2:
        return list(ys)
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= window:
            acc -= ys[i - window]
        out.append(acc / min(i + 1, window))
    return out


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Records of a ``metrics.jsonl`` (or of a run directory), sorted by step.

    Records of the same step merge into one, later values winning: a step logged again after
    a resume (killed after logging, before its checkpoint) keeps the newer values, and
    different metric sets logged at the same step (per-update and per-step records) are both
    kept. Records without a ``step`` keep their file order at the end. Truncated lines (a
    crash mid-write) are skipped.
    """
    p = Path(path)
    if p.is_dir():
        p = p / METRICS_FILE
    if not p.is_file():
        raise ValueError(f"no metrics file at {p}: pass a metrics.jsonl or a run directory "
                         f"containing one")
    by_step: dict[float, dict] = {}
    other: list[dict] = []
    with open(p) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(rec, dict):
                continue
            if isinstance(rec.get("step"), (int, float)):
                by_step.setdefault(rec["step"], {}).update(rec)
            else:
                other.append(rec)
    return [by_step[s] for s in sorted(by_step)] + other


# --------------------------------------------------------------------------------------------
# Sinks


class MetricsLogger:
    """JSONL + TensorBoard (+ W&B when ``wandb_project`` is set) for one run directory.

    Example::

        ml = MetricsLogger("runs/x", config_dict=config_to_dict(cfg)  # megatron_m2po.config.config_to_dict, enabled=rank == 0)
        ml.log({"rollout/reward_mean": 0.4, "staleness/hist": [0, 12, 30]}, step=3)
        ml.close()

    ``enabled=False`` (ranks other than 0) makes every method a no-op. Each call is flushed to
    disk before returning, so a killed run loses at most the record being written.
    """

    def __init__(self, run_dir: str | os.PathLike, *, config_dict: Mapping[str, Any] | None = None,
                 wandb_project: str = "", wandb_run_name: str = "", enabled: bool = True,
                 tensorboard: bool = True) -> None:
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self._jsonl = None
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        if wandb_project:
            self._wandb = _init_wandb(self.run_dir, wandb_project, wandb_run_name, config_dict)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if config_dict is not None:
            (self.run_dir / CONFIG_FILE).write_text(
                json.dumps(_to_jsonable(config_dict), indent=2, sort_keys=True) + "\n")
        path = self.run_dir / METRICS_FILE
        torn = path.is_file() and path.stat().st_size > 0 and _last_byte(path) != b"\n"
        self._jsonl = open(path, "a", encoding="utf-8")
        if torn:  # a crash mid-write left half a line: end it so the next record stands alone
            self._jsonl.write("\n")
            self._jsonl.flush()
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / TB_DIR), flush_secs=10)

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / METRICS_FILE

    def log(self, metrics: Mapping[str, Any], step: int, *, x: Optional[int] = None) -> None:
        """Write one record ``{"step": step, "time": unix_seconds, **metrics}``; TensorBoard plots it
        at ``x`` (default ``step``): the trainer's step records at the training step, as the console
        and ``tools/plot_metrics.py`` count, while ``step`` stays the weight version. W&B keeps
        ``step`` (it drops a record whose step is below the last one's)."""
        if not self.enabled:
            return
        if self._jsonl is None:
            raise ValueError("MetricsLogger.log() after close()")
        values = {str(k): _to_python(v) for k, v in metrics.items()}
        record = {"step": int(step), "time": round(time.time(), 3), **values}
        self._jsonl.write(json.dumps(record, allow_nan=False) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            self._write_tb(values, int(step if x is None else x))
        if self._wandb is not None:
            self._write_wandb(values, int(step))

    def _write_tb(self, values: dict[str, Any], step: int) -> None:
        for k, v in values.items():
            if isinstance(v, (int, float)):
                self._tb.add_scalar(k, v, step)
            elif isinstance(v, list) and v:
                arr = np.asarray([x for x in v if x is not None], dtype=np.float64)
                if arr.size == 0:
                    continue
                if k.endswith("/hist"):
                    if arr.sum() <= 0:
                        continue
                    bins = np.arange(arr.size, dtype=np.float64)
                    nz = np.nonzero(arr)[0]
                    self._tb.add_histogram_raw(
                        k, min=float(nz[0]), max=float(nz[-1]), num=float(arr.sum()),
                        sum=float((bins * arr).sum()), sum_squares=float((bins ** 2 * arr).sum()),
                        bucket_limits=(bins + 0.5).tolist(), bucket_counts=arr.tolist(),
                        global_step=step)
                else:
                    self._tb.add_histogram(k, arr, step)
        self._tb.flush()

    def _write_wandb(self, values: dict[str, Any], step: int) -> None:
        import wandb

        out: dict[str, Any] = {}
        for k, v in values.items():
            if isinstance(v, (int, float)):
                out[k] = v
            elif isinstance(v, list) and v:
                arr = [x for x in v if x is not None]
                if k.endswith("/hist"):
                    out[k] = wandb.Histogram(np_histogram=(np.asarray(arr), np.arange(len(arr) + 1) - 0.5))
                else:
                    out[k] = wandb.Histogram(arr)
        self._wandb.log(out, step=step)

    def rewind(self, version: int) -> int:
        """Drop the records of metrics.jsonl past ``version`` (a resumed run logs those updates
        again; a run killed before its first checkpoint resumes at 0 and keeps none), so the file
        holds each update once. Returns the number of lines dropped (torn lines included)."""
        if not self.enabled or self._jsonl is None:
            return 0
        self._jsonl.close()
        path = self.metrics_path
        keep, dropped = [], 0
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
                ok = isinstance(rec, dict) and int(rec.get("step", version + 1)) <= version
            except (ValueError, TypeError):
                ok = False
            if ok:
                keep.append(line + "\n")
            else:
                dropped += bool(line.strip())
        if dropped:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(keep), encoding="utf-8")
            os.replace(tmp, path)
        self._jsonl = open(path, "a", encoding="utf-8")
        return dropped

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _last_byte(path: Path) -> bytes:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1)


def _to_jsonable(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {str(k): _to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_to_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


def _init_wandb(run_dir: Path, project: str, name: str, config_dict: Mapping | None):
    try:
        import wandb
    except ImportError as e:
        raise ValueError(
            f"logging.wandb_project={project!r} is set but the wandb package is not installed: "
            f"`pip install wandb` (or `pip install megatron-m2po[wandb]`), or set "
            f"logging.wandb_project='' to log to JSONL and TensorBoard only") from e
    run_dir.mkdir(parents=True, exist_ok=True)
    id_file = run_dir / WANDB_ID_FILE
    run_id = id_file.read_text().strip() if id_file.is_file() else wandb.util.generate_id()
    id_file.write_text(run_id + "\n")
    return wandb.init(project=project, name=name or run_dir.name, id=run_id, resume="allow",
                      dir=str(run_dir), config=_to_jsonable(dict(config_dict or {})))


# --------------------------------------------------------------------------------------------
# Progress display

# (metric keys tried in order, label, formatter)
_PROGRESS_FIELDS: list[tuple[tuple[str, ...], str, str]] = [
    (("rollout/reward_mean",), "reward", "{:.3f}"),
    (("rollout/acc", "eval/acc"), "acc", "{:.3f}"),
    (("m2po/mask_frac",), "mask", "{:.2%}"),
    (("loss/clip_frac",), "clip", "{:.2%}"),
    (("staleness/mean",), "stale", "{:.1f}"),
    (("staleness/max",), "max", "{:.0f}"),
    (("policy/kl_k3",), "kl", "{:.2e}"),
    (("ref/kl",), "ref kl", "{:.2e}"),
    (("distill/reverse_kl",), "rev kl", "{:.2e}"),  # algo.distill: KL(student || teacher) per token
    (("perf/tokens_per_s",), "tok/s", "{:.0f}"),
]
# Every loss that masks tokens logs "<loss>/mask_frac" (m2po, icepop, mis, areal_m2po, a plugin's):
# the console's mask column shows whichever the run's loss logged.
_MASK_SUFFIX = "/mask_frac"


def format_progress(metrics: Mapping[str, Any]) -> str:
    """``"reward 0.412 | acc 0.310 | mask 0.31% | stale 4.0 | max 7 | tok/s 1234"`` from what
    is present: the mask of whichever loss masks tokens, the reference KL when ``algo.kl`` is on, the
    reverse KL to the teacher when ``algo.distill`` is on."""
    parts = []
    masks = tuple(sorted(k for k in metrics if k.endswith(_MASK_SUFFIX) and k.count("/") == 1))
    for keys, label, fmt in _PROGRESS_FIELDS:
        for k in (keys + masks if label == "mask" else keys):
            v = metrics.get(k)
            if isinstance(v, (int, float, np.generic)) and math.isfinite(float(v)):
                parts.append(f"{label} {fmt.format(float(v))}")
                break
    return " | ".join(parts)


class TrainProgress:
    """Step counter with the key metrics.

    A rich live bar when ``enabled`` and stderr is a terminal (``live`` forces the choice);
    otherwise plain INFO log lines through the ``megatron_m2po`` logger, at most one per
    ``min_interval_s`` and always the last step, e.g.
    ``step 3/100 | reward 0.412 | acc 0.310 | mask 0.31% | stale 4.0 | max 7 | eta 5m10s``.
    Under :func:`setup_logging` ranks other than 0 drop INFO lines, so every rank may own one.

    The ETA counts only the steps this process ran, since it was constructed: ``start_step``
    when given, else the step before the first :meth:`update` (a resumed run's first update is
    of step ``resume + 1``; the steps before it were not timed here).
    """

    def __init__(self, total_steps: int, enabled: bool = True, *, live: bool | None = None,
                 start_step: int | None = None, min_interval_s: float = 0.0,
                 description: str = "train") -> None:
        self.total = int(total_steps)
        self.enabled = enabled
        self.step = int(start_step or 0)
        self.min_interval_s = min_interval_s
        self._last_line = -math.inf
        self._t0 = time.monotonic()
        self._start_step = start_step  # None: the step before the first update
        self._progress = None
        if live is None:
            live = sys.stderr.isatty()
        if enabled and live:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeElapsedColumn, TimeRemainingColumn)

            self._progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                TextColumn("{task.fields[stats]}"),
                console=Console(stderr=True), transient=False)
            self._task = self._progress.add_task(description, total=self.total,
                                                 completed=self.step, stats="")
            self._progress.start()

    @property
    def is_live(self) -> bool:
        return self._progress is not None

    def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        """Record that ``step`` (1-based count of finished steps) is done, with its metrics."""
        self.step = int(step)
        if self._start_step is None:
            self._start_step = self.step - 1
            if self._progress is not None and self._start_step > 0:
                # rich's remaining time is the speed of the bar's samples: the resumed steps
                # are not a sample of this process's speed (reset clears them).
                self._progress.reset(self._task, completed=self._start_step)
        stats = format_progress(metrics or {})
        if self._progress is not None:
            self._progress.update(self._task, completed=self.step, stats=stats)
            return
        now = time.monotonic()
        if now - self._last_line < self.min_interval_s and self.step < self.total:
            return
        self._last_line = now
        log.info("step %d/%d%s%s", self.step, self.total, f" | {stats}" if stats else "",
                 self._eta())

    def _eta(self) -> str:
        done = self.step - (self._start_step or 0)
        if done <= 0 or self.step >= self.total:
            return ""
        per = (time.monotonic() - self._t0) / done
        return f" | eta {_fmt_secs(per * (self.total - self.step))}"

    def message(self, text: str) -> None:
        """A line printed above the live bar (or logged)."""
        if self._progress is not None:
            console = self._progress.console
            console.log(text)
        else:
            log.info("%s", text)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __enter__(self) -> "TrainProgress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _fmt_secs(s: float) -> str:
    s = int(round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


# --------------------------------------------------------------------------------------------
# Python logging


class _StderrHandler(logging.StreamHandler):
    """Writes to the *current* ``sys.stderr`` so lines land above a rich live display (which
    swaps ``sys.stderr`` while it runs) instead of tearing it."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it
        pass


_HANDLER_ATTR = "_m2po_handler"


def setup_logging(rank: int = 0, *, level: str | int = "INFO", all_ranks: bool = False,
                  access_log: bool = False) -> None:
    """Configure the root logger: ``[rank N] HH:MM:SS LEVEL name: message`` on stderr.

    aiohttp's per-request access lines (``aiohttp.access``, one per push to the trainer's
    ingestion server) reach the console only with ``access_log`` (``logging.access_log``).

    Rank 0 logs at ``level``; other ranks log warnings and errors only unless ``all_ranks``.
    Calling it again replaces the handler it installed (idempotent).
    """
    if isinstance(level, str):
        lvl = logging.getLevelName(level.upper())
        if not isinstance(lvl, int):
            raise ValueError(f"unknown log level {level!r}; use DEBUG, INFO, WARNING or ERROR")
        level = lvl
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, _HANDLER_ATTR, False):
            root.removeHandler(h)
    handler = _StderrHandler()
    setattr(handler, _HANDLER_ATTR, True)
    handler.setFormatter(logging.Formatter(
        f"[rank {rank}] %(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(level if (rank == 0 or all_ranks) else max(level, logging.WARNING))
    for noisy in ("matplotlib", "PIL", "urllib3", "httpx", "filelock", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.getLogger("aiohttp.access").setLevel(logging.INFO if access_log else logging.WARNING)
