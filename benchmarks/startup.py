"""What a run pays before its first step: compiled programs, compile time, warm-up.

Runs a config (default: the README's main job, ``configs/tiny.py``) in this
process with the persistent compilation cache off, and counts every XLA
compile through JAX's monitoring events (the backend-compile duration event,
which names the compiled function). Compiles are split at the moment the
run's training clock starts: those before it are the warm-up
(``config.precompile``); any after it stalled a step mid-run. The table
groups them by function name, so "how many decode programs" is read off, and
the run's own summary (steps, trained tok/s, bubble, eval reward, integrity)
is printed beside it: a refactor must leave both unchanged or explain why.

Usage: python benchmarks/startup.py [--config configs/tiny.py] [--json FILE]
                                    [--config.x=y ...]
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import pathlib
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jax_dora.runtime import cpu_friendly_env  # noqa: E402  pylint: disable=wrong-import-position

cpu_friendly_env()

import jax  # noqa: E402  pylint: disable=wrong-import-position
import ml_collections  # noqa: E402  pylint: disable=wrong-import-position

# jax._src.dispatch.BACKEND_COMPILE_EVENT: recorded once per XLA compile with
# the jitted function's name (not a public constant, so spelled out here).
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileLog:
  """Every backend compile of this process: (end time, seconds, function name)."""

  def __init__(self):
    self.events: list[tuple[float, float, str]] = []
    jax.monitoring.register_event_duration_secs_listener(self._on_event)

  def _on_event(self, event: str, duration: float, **kwargs) -> None:
    if event == COMPILE_EVENT:
      self.events.append((time.time(), float(duration), str(kwargs.get("fun_name", "?"))))

  def split(self, at: float) -> tuple[list, list]:
    before = [e for e in self.events if e[0] <= at]
    return before, [e for e in self.events if e[0] > at]


def load_config(path: str, overrides: list[str]) -> ml_collections.ConfigDict:
  """``get_config()`` of a config file, with ``--config.x=y`` overrides applied."""
  spec = importlib.util.spec_from_file_location("run_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  cfg = module.get_config()
  for item in overrides:
    key, _, value = item.removeprefix("--config.").partition("=")
    node, *rest = key.split(".")[::-1]
    parent = cfg
    for part in reversed(rest):
      parent = parent[part]
    current = parent[node]
    parent[node] = (value.lower() in ("1", "true", "yes") if isinstance(current, bool)
                    else type(current)(value) if current is not None else value)
  return cfg


def by_name(events: list[tuple[float, float, str]]) -> dict[str, dict]:
  table: dict[str, dict] = collections.defaultdict(lambda: {"count": 0, "seconds": 0.0})
  for _, secs, name in events:
    table[name]["count"] += 1
    table[name]["seconds"] += secs
  return dict(sorted(table.items(), key=lambda kv: -kv[1]["seconds"]))


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--config", default=str(ROOT / "configs" / "tiny.py"))
  ap.add_argument("--json", default="", help="write the table and the run summary here")
  args, overrides = ap.parse_known_args()
  cfg = load_config(args.config, overrides)
  cfg.compile_cache_dir = ""  # count compiles, not cache loads
  cfg.progress_bar = False
  tmp = tempfile.TemporaryDirectory(prefix="jax_dora_startup_")
  cfg.output_dir = str(pathlib.Path(tmp.name) / "run")

  from jax_dora.runtime import run_training  # pylint: disable=g-import-not-at-top

  compiles = CompileLog()
  clock: dict[str, float] = {}

  def after_step(rec, _orch) -> None:
    clock.setdefault("train_start", time.time() - float(rec["wall_time_s"]))

  t0 = time.time()
  summary = run_training(cfg, after_step=after_step)
  total_s = time.time() - t0
  start = clock.get("train_start", time.time())
  warm, mid = compiles.split(start)
  result = {
      "config": args.config,
      "overrides": overrides,
      "startup_s": start - t0,
      "total_s": total_s,
      "warmup_compiles": len(warm),
      "warmup_compile_s": sum(e[1] for e in warm),
      "midrun_compiles": len(mid),
      "midrun_compile_s": sum(e[1] for e in mid),
      "warmup_by_function": by_name(warm),
      "midrun_by_function": by_name(mid),
      "run": {k: summary.get(k) for k in ("mode", "steps", "wall_time_s", "trained_tokens_per_s",
                                          "initial_eval_reward", "final_eval_reward",
                                          "final_eval_reward_stderr", "integrity_violations",
                                          "rejected_groups")},
  }
  print(f"start-up (process start of run_training -> training clock): {result['startup_s']:.1f} s")
  print(f"compiles before the clock: {len(warm)} ({result['warmup_compile_s']:.1f} s);"
        f" mid-run: {len(mid)} ({result['midrun_compile_s']:.1f} s)")
  print(f"{'function':<48} {'warm-up':>8} {'s':>7} {'mid-run':>8}")
  names = list(result["warmup_by_function"]) + [
      n for n in result["midrun_by_function"] if n not in result["warmup_by_function"]]
  for name in names:
    w = result["warmup_by_function"].get(name, {"count": 0, "seconds": 0.0})
    m = result["midrun_by_function"].get(name, {"count": 0})
    print(f"{name[:48]:<48} {w['count']:>8} {w['seconds']:>7.1f} {m['count']:>8}")
  print("run:", json.dumps(result["run"], default=str))
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(result, indent=2, default=str))
  tmp.cleanup()


if __name__ == "__main__":
  main()
