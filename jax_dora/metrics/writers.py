"""TensorBoard and Weights & Biases views of the per-step metrics records.

The JSONL file (:mod:`jax_dora.metrics.jsonl`) stays the source of truth: the
integrity audit, the benchmarks and ``jax_dora.report`` read it. These writers
only mirror each record into the dashboards people already use, so a run can
be watched live in TensorBoard or W&B like a MaxText or Tunix run:

* scalars: every numeric field of the record (nested blocks such as
  ``pace`` become ``pace/<key>``), plus ``mean``/``max`` of each staleness
  histogram;
* histograms: the staleness distributions (``staleness_generation``,
  ``..._waiting``, ``..._effective``, ``..._behaviour``) as real histograms;
* text: a few decoded completions (prompt, completion, reward) per step.

TensorBoard files are written with ``tensorboardX`` (protobuf only; it does
not import TensorFlow, which would add seconds and CUDA-stub noise to every
start), W&B with the ``wandb`` client (``mode="offline"`` works without a
network and leaves a run directory ``wandb sync`` uploads later).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from typing import Any, Protocol, Self

from jax_dora.metrics.histogram import histogram_counts
from jax_dora.metrics.jsonl import MetricsWriter, is_remote

log = logging.getLogger(__name__)

_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
# Record fields that are bookkeeping, not curves.
_NOT_SCALARS = ("step", "time")
WANDB_MODES = ("online", "offline", "disabled")


def is_histogram(value: Any) -> bool:
  """True for a :func:`jax_dora.metrics.histogram.staleness_histogram` dict."""
  return isinstance(value, dict) and {"mean", "max", "n"} <= value.keys()


def _number(v: Any) -> float | None:
  if isinstance(v, bool):
    return float(v)
  if isinstance(v, (int, float)):
    return float(v)
  if isinstance(v, str) and v in _NON_FINITE:
    return _NON_FINITE[v]
  return None


def flatten_scalars(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
  """Every numeric field of ``record`` as ``{tag: value}``; nested dicts join with ``/``.

  A staleness histogram contributes its ``mean`` and ``max`` (its buckets go
  to :func:`histograms`); strings other than the non-finite markers of
  :func:`jax_dora.metrics.jsonl.to_jsonable`, lists and None are skipped.
  """
  out: dict[str, float] = {}
  for k, v in record.items():
    if not prefix and k in _NOT_SCALARS:
      continue
    tag = f"{prefix}{k}"
    if is_histogram(v):
      for part in ("mean", "max"):
        x = _number(v.get(part))
        if x is not None:
          out[f"{tag}/{part}"] = x
    elif isinstance(v, dict):
      out.update(flatten_scalars(v, prefix=f"{tag}/"))
    else:
      x = _number(v)
      if x is not None:
        out[tag] = x
  return out


def histograms(record: dict[str, Any]) -> dict[str, dict[int, int]]:
  """``{name: {bucket: count}}`` of the non-empty staleness histograms of ``record``."""
  return {k: histogram_counts(v) for k, v in record.items()
          if is_histogram(v) and v.get("n")}


class Sink(Protocol):
  """Somewhere a metrics record (already JSON-converted) is mirrored to."""

  def write(self, record: dict[str, Any]) -> None: ...

  def write_samples(self, step: int, samples: Sequence[dict[str, Any]]) -> None: ...

  def close(self) -> None: ...


def samples_markdown(samples: Sequence[dict[str, Any]]) -> str:
  """A markdown table of decoded completions (what TensorBoard's text tab renders)."""

  def cell(s: Any) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")

  rows = ["| sample | reward | prompt | completion |", "|---|---|---|---|"]
  rows += [f"| {cell(s.get('sample', ''))} | {float(s['reward']):.3f} | {cell(s['prompt'])}"
           f" | {cell(s['completion'])} |" for s in samples]
  return "\n".join(rows)


class TensorBoardSink:
  """Event files under ``logdir`` (open with ``tensorboard --logdir``)."""

  def __init__(self, logdir: str, purge_step: int | None = None):
    from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top

    self.logdir = logdir
    # purge_step: a resumed run rewrites the steps a killed run logged after
    # its checkpoint; TensorBoard then hides the killed run's copies.
    self._w = SummaryWriter(logdir, purge_step=purge_step, flush_secs=10)

  def write(self, record: dict[str, Any]) -> None:
    step = int(record["step"])
    for tag, value in flatten_scalars(record).items():
      self._w.add_scalar(tag, value, step)
    for tag, counts in histograms(record).items():
      buckets = sorted(counts)
      n = sum(counts.values())
      mean = _number(record[tag].get("mean"))
      self._w.add_histogram_raw(
          tag, min=float(buckets[0]), max=float(record[tag].get("max") or buckets[-1]), num=n,
          sum=float(mean * n) if mean is not None else float(sum(b * c for b, c in counts.items())),
          sum_squares=float(sum(b * b * c for b, c in counts.items())),
          # Integer buckets: the right edge of bucket b is b + 0.5.
          bucket_limits=[b + 0.5 for b in buckets], bucket_counts=[counts[b] for b in buckets],
          global_step=step)

  def write_samples(self, step: int, samples: Sequence[dict[str, Any]]) -> None:
    if samples:
      self._w.add_text("samples", samples_markdown(samples), step)

  def flush(self) -> None:
    self._w.flush()

  def close(self) -> None:
    self._w.close()


class WandbSink:
  """One W&B run per run incarnation (``metrics.wandb_*``)."""

  def __init__(self, *, project: str, entity: str, mode: str, directory: str, name: str,
               config: dict[str, Any]):
    try:
      import wandb  # pylint: disable=g-import-not-at-top
    except ImportError:
      raise ImportError("metrics.wandb_project is set but wandb is not installed:"
                        " pip install 'jax-dora[wandb]' (or wandb)") from None

    self._wandb = wandb
    os.makedirs(directory, exist_ok=True)
    self.run = wandb.init(project=project, entity=entity or None, mode=mode, dir=directory,
                          name=name, config=config,
                          settings=wandb.Settings(silent=True, console="off"))
    # The run's own directory (``offline-run-...``); run.dir is its files/.
    self.dir = os.path.dirname(self.run.dir.rstrip("/"))

  def write(self, record: dict[str, Any]) -> None:
    data: dict[str, Any] = dict(flatten_scalars(record))
    for tag, counts in histograms(record).items():
      lo, hi = min(counts), max(counts)
      data[f"{tag}/hist"] = self._wandb.Histogram(np_histogram=(
          [counts.get(b, 0) for b in range(lo, hi + 1)], [b - 0.5 for b in range(lo, hi + 2)]))
    self.run.log(data, step=int(record["step"]))

  def write_samples(self, step: int, samples: Sequence[dict[str, Any]]) -> None:
    if samples:
      cols = ["sample", "reward", "prompt", "completion"]
      table = self._wandb.Table(columns=cols, data=[[s.get(c, "") for c in cols] for s in samples])
      self.run.log({"samples": table}, step=step)

  def flush(self) -> None:
    pass

  def close(self) -> None:
    self.run.finish()


class RunMetrics:
  """The run's metrics: the JSONL file plus its dashboard mirrors.

  ``write(record)`` has :class:`MetricsWriter`'s contract (the orchestrator
  and the checkpoint code only see this object).
  """

  def __init__(self, jsonl: MetricsWriter, sinks: Sequence[Any] = ()):
    self.jsonl = jsonl
    self.sinks = list(sinks)

  def write(self, record: dict[str, Any]) -> dict[str, Any]:
    line = self.jsonl.write(record)
    for s in self.sinks:
      s.write(line)
    return line

  def write_samples(self, step: int, samples: Sequence[dict[str, Any]]) -> None:
    for s in self.sinks:
      s.write_samples(step, samples)

  def flush(self) -> None:
    self.jsonl.flush()
    for s in self.sinks:
      s.flush()

  def close(self) -> None:
    self.jsonl.close()
    for s in self.sinks:
      s.close()

  def __enter__(self) -> Self:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def tensorboard_dir(output_dir: str) -> str:
  return os.path.join(os.fspath(output_dir), "tensorboard")


def open_run_metrics(cfg: Any, metrics_path: Any, *, resumed_step: int | None,
                     incarnation: str) -> RunMetrics:
  """The JSONL writer plus the sinks ``cfg.metrics`` asks for."""
  jsonl = MetricsWriter(metrics_path, keep_through_step=resumed_step or 0)
  sinks: list[Any] = []
  out = os.fspath(cfg.output_dir)
  if cfg.metrics.tensorboard:
    if is_remote(out):
      log.warning("metrics.tensorboard: %s is an object store; TensorBoard files are written"
                  " locally only (the JSONL file has every record)", out)
    else:
      sinks.append(TensorBoardSink(tensorboard_dir(out),
                                   purge_step=(resumed_step + 1) if resumed_step else None))
  if cfg.metrics.wandb_project:
    sinks.append(WandbSink(
        project=cfg.metrics.wandb_project, entity=cfg.metrics.wandb_entity,
        mode=cfg.metrics.wandb_mode,
        directory=out if not is_remote(out) else os.path.abspath("wandb_runs"),
        name=f"{os.path.basename(out.rstrip('/'))}-{incarnation}", config=cfg.to_dict()))
  return RunMetrics(jsonl, sinks)
