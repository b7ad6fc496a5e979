"""Staleness histograms small enough to put in every metrics line.

Mean staleness hides the tail that the hard bound and PACE care about, so each
step logs the full distribution: ``{"0": n0, "1": n1, ..., "mean": m, "max": k,
"n": count}``. Bucket keys are strings (JSON object keys) of the value rounded
to the nearest integer, since token-weighted generation staleness of resumed
rollouts is fractional; ``mean`` and ``max`` use the exact values.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable
from typing import Any


def staleness_histogram(values: Iterable[float]) -> dict[str, Any]:
  """Histogram plus summary of staleness values (``mean``/``max`` None if empty)."""
  vals = [float(v) for v in values]
  counts = collections.Counter(int(math.floor(v + 0.5)) for v in vals)
  out: dict[str, Any] = {str(k): counts[k] for k in sorted(counts)}
  out["mean"] = sum(vals) / len(vals) if vals else None
  mx = max(vals) if vals else None
  out["max"] = int(mx) if mx is not None and mx == int(mx) else mx
  out["n"] = len(vals)
  return out


def histogram_counts(hist: dict[str, Any]) -> dict[int, int]:
  """The bucket part of a :func:`staleness_histogram` result, keyed by int."""
  return {int(k): int(v) for k, v in hist.items() if k.lstrip("-").isdigit()}
