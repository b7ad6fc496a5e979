"""RL from the shipped base model: held-out pass@1 against minutes of training, over seeds.

Issue 36's learning check on a policy with a prior: ``configs/tiny_math.py``
(``dora_pace`` from the shipped ``jax_dora/base_model/jax-dora-math-base``) trains for ``--budget_s``
seconds of training wall clock per seed (the clock starts after start-up and
compilation, which are reported beside it), keeping every policy snapshot.
Afterwards, the versions that were the newest published at ``0, every_s,
2 every_s, ...`` are evaluated on the same held-out prompts by
``python -m jax_dora.evaluate --steps`` on its own servers (evaluation never
runs inside the training clock): pass@1 at temperature 1 (mean over
``--eval_samples`` samples per prompt) and greedy pass@1.

Prints, per scheduled point, the mean and standard deviation over seeds, and
each seed's rise (pass@1 at the budget minus at 0); writes the JSON and a plot
(``--plot``, default ``docs/figures/rl_from_base.png``).

Usage::

  python benchmarks/rl_from_base.py --seeds 3 --budget_s 900 --every_s 150 --out runs/rl_from_base
  python benchmarks/rl_from_base.py --from_json runs/rl_from_base/rl_from_base.json   # table + plot again
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _procs import evaluate_versions  # pylint: disable=wrong-import-position
from jax_dora.metrics import reward_curves as rc  # pylint: disable=wrong-import-position
from jax_dora.metrics.jsonl import read_jsonl  # pylint: disable=wrong-import-position
from jax_dora.report import headline  # pylint: disable=wrong-import-position

CONFIG = "configs/tiny_math.py"


def _env() -> dict[str, str]:
  env = dict(os.environ)
  env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  env.setdefault("JAX_PLATFORMS", "cpu")
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  return env


def cold_cache_dir(run_dir: pathlib.Path) -> pathlib.Path:
  """The compilation cache a cold-started run of ``run_dir`` fills (deleted after its curve)."""
  return run_dir.parent / f"{run_dir.name}_xla_cache"


def train(seed: int, out: pathlib.Path, budget_s: float, overrides: list[str],
          cold_cache: bool = True, config: str = CONFIG) -> dict:
  """One ``jax_dora.train`` run of ``config`` for ``budget_s`` seconds; returns its summary.

  ``cold_cache``: the run compiles into an empty cache directory of its own
  (the issue's "from a cold compilation cache"), so its start-up is what a
  first run on a fresh machine pays.
  """
  if cold_cache:
    cache = cold_cache_dir(out)
    shutil.rmtree(cache, ignore_errors=True)
    overrides = [f"--config.compile_cache_dir={cache}", *overrides]
  cmd = [sys.executable, "-m", "jax_dora.train", f"--config={config}",
         f"--config.seed={seed}", f"--config.output_dir={out}",
         f"--config.max_wall_time_s={budget_s}", "--config.total_steps=1000000",
         "--config.snapshots.max_to_keep=0", "--config.eval.num_prompts=0",
         "--config.eval.at_start=False", "--config.checkpoint.resume=False",
         "--config.progress_bar=False", *overrides]
  t0 = time.time()
  with open(out.parent / f"{out.name}.log", "w") as log:
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT)
  if proc.returncode != 0:
    raise SystemExit(f"seed {seed}: training failed (exit {proc.returncode}); see {out}.log")
  summary = json.loads((out / "summary.json").read_text())
  summary["process_seconds"] = time.time() - t0
  return summary


def evaluate(run_dir: pathlib.Path, versions: list[int], num_prompts: int, samples: int,
             greedy: bool) -> dict[int, dict]:
  """``jax_dora.evaluate --steps`` of ``versions``: ``{version: metrics}``."""
  return evaluate_versions(run_dir, versions, num_prompts=num_prompts, num_samples=samples,
                           greedy=greedy, env=_env(),
                           out=run_dir / f"eval_{'greedy' if greedy else f't1x{samples}'}.json")


_WORKED_LINE = re.compile(r"^\d+ [-+*/] \d+ = (\d+)$")
_ANSWER_LINE = re.compile(r"^#### (\S+)$")


def miscopied_share(completions: list[str]) -> float | None:
  """Share of completions whose ``#### N`` is not the result of their own last worked line.

  The base model's SFT teacher miscopied 40% of its answer lines
  (``jax_dora.data.word_problems``); this measures the habit in the policy's
  own samples, read off their text, whatever the arithmetic before it.
  Completions without both lines are not counted; None if none has them.
  """
  counted = miscopied = 0
  for text in completions:
    lines = [l.strip() for l in text.strip().splitlines() if l.strip()]
    if len(lines) < 2:
      continue
    worked, answer = _WORKED_LINE.match(lines[-2]), _ANSWER_LINE.match(lines[-1])
    if worked and answer:
      counted += 1
      miscopied += worked.group(1) != answer.group(1)
  return miscopied / counted if counted else None


def curve(run_dir: pathlib.Path, budget_s: float, every_s: float, num_prompts: int,
          samples: int) -> list[dict]:
  recs = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
  points = rc.scheduled_versions(recs, budget_s, every_s)
  versions = sorted({v for _, v in points})
  sampled = evaluate(run_dir, versions, num_prompts, samples, greedy=False)
  greedy = evaluate(run_dir, versions, num_prompts, 1, greedy=True)
  return [{"t": t, "version": v, "pass@1": sampled[v]["eval/pass@1"],
           f"pass@{samples}": sampled[v].get(f"eval/pass@{samples}"),
           "miscopied": miscopied_share([o["completion"] for o in sampled[v]["samples"]]),
           "greedy_pass@1": greedy[v]["eval/pass@1"]} for t, v in points]


def table(result: dict) -> None:
  runs = result["runs"]
  ts = [p["t"] for p in runs[0]["curve"]]
  print(f"\n{'minutes':>8}{'pass@1 (t=1)':>20}{'greedy pass@1':>20}{'miscopied (t=1)':>20}"
        f"   (mean ± std over {len(runs)} seed(s))")
  for i, t in enumerate(ts):
    a = np.array([r["curve"][i]["pass@1"] for r in runs])
    g = np.array([r["curve"][i]["greedy_pass@1"] for r in runs])
    m = np.array([r["curve"][i].get("miscopied") for r in runs], dtype=float)
    print(f"{t / 60:>8.1f}{a.mean():>13.3f} ± {a.std():.3f}{g.mean():>13.3f} ± {g.std():.3f}"
          f"{np.nanmean(m) if not np.isnan(m).all() else float('nan'):>13.3f} ±"
          f" {np.nanstd(m) if not np.isnan(m).all() else float('nan'):.3f}")
  for r in runs:
    c = r["curve"]
    print(f"seed {r['seed']}: pass@1 {c[0]['pass@1']:.3f} -> {c[-1]['pass@1']:.3f}"
          f" ({100 * (c[-1]['pass@1'] - c[0]['pass@1']):+.1f} points), greedy"
          f" {c[0]['greedy_pass@1']:.3f} -> {c[-1]['greedy_pass@1']:.3f}; {r['steps']} steps,"
          f" start-up {r['startup_s']:.0f}s, bubble {r['bubble_ratio']:.2f},"
          f" integrity violations {r['integrity_violations']}")


def plot(result: dict, path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, ax = plt.subplots(figsize=(6.4, 4.0))
  for key, color, label in (("pass@1", "C0", "pass@1, temperature 1"),
                            ("greedy_pass@1", "C1", "greedy pass@1")):
    for r in result["runs"]:
      ax.plot([p["t"] / 60 for p in r["curve"]], [p[key] for p in r["curve"]], color=color,
              alpha=0.3, lw=1)
    ts = [p["t"] / 60 for p in result["runs"][0]["curve"]]
    mean = np.mean([[p[key] for p in r["curve"]] for r in result["runs"]], axis=0)
    ax.plot(ts, mean, color=color, lw=2.2, label=f"{label} (mean of {len(result['runs'])} seeds)")
  if all(p.get("miscopied") is not None for r in result["runs"] for p in r["curve"]):
    twin = ax.twinx()  # the base's planted habit, read off the same samples
    ts = [p["t"] / 60 for p in result["runs"][0]["curve"]]
    mean = np.mean([[p["miscopied"] for p in r["curve"]] for r in result["runs"]], axis=0)
    twin.plot(ts, mean, color="0.45", ls="--", lw=1.6,
              label="samples miscopying their answer line (right axis)")
    twin.set_ylim(0, 1)
    twin.set_ylabel("miscopied share, temperature 1")
    twin.legend(loc="center right", fontsize=8)
  ax.set_xlabel("training wall clock (minutes, 2-core CPU)")
  ax.set_ylabel(f"held-out pass@1 ({result['eval_prompts']} problems)")
  ax.set_title("dora_pace RL from the shipped base model (configs/tiny_math.py)")
  ax.grid(alpha=0.3)
  ax.legend(loc="lower right")
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=120)
  print(f"plot: {path}")


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--seeds", type=int, default=3)
  ap.add_argument("--budget_s", type=float, default=900.0, help="training wall clock per seed")
  ap.add_argument("--every_s", type=float, default=150.0, help="evaluation schedule")
  ap.add_argument("--eval_prompts", type=int, default=200)
  ap.add_argument("--eval_samples", type=int, default=4)
  ap.add_argument("--out", default="runs/rl_from_base")
  ap.add_argument("--plot", default="docs/figures/rl_from_base.png")
  ap.add_argument("--from_json", default="", help="print and plot a finished result again")
  ap.add_argument("--warm_cache", action="store_true",
                  help="use the shared compilation cache (default: each seed starts cold)")
  ap.add_argument("overrides", nargs="*", help="--config.x=y for every run")
  a = ap.parse_args()
  if a.from_json:
    result = json.loads(pathlib.Path(a.from_json).read_text())
  else:
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for seed in range(a.seeds):
      run_dir = out / f"seed{seed}"
      s = train(seed, run_dir, a.budget_s, a.overrides, cold_cache=not a.warm_cache)
      c = curve(run_dir, a.budget_s, a.every_s, a.eval_prompts, a.eval_samples)
      shutil.rmtree(run_dir / "snapshots", ignore_errors=True)  # ~13 MB a version, all kept
      shutil.rmtree(cold_cache_dir(run_dir), ignore_errors=True)
      records = read_jsonl(run_dir / "metrics.jsonl")
      runs.append({"seed": seed, "curve": c, "steps": s["steps"],
                   "startup_s": s["process_seconds"] - s["wall_time_s"],
                   "trained_tokens_per_s": s["trained_tokens_per_s"],
                   "bubble_ratio": headline(records, s).get("bubble"),
                   "wasted_share": s["wasted_rollout_tokens"] / max(s["generated_tokens"], 1),
                   "rejected_groups": s["rejected_groups"],
                   "integrity_violations": len(s.get("integrity_violations") or [])})
      print(f"seed {seed}: pass@1 {c[0]['pass@1']:.3f} -> {c[-1]['pass@1']:.3f}", flush=True)
    result = {"date": datetime.datetime.now().isoformat(timespec="minutes"), "config": CONFIG,
              "cold_cache": not a.warm_cache,
              "budget_s": a.budget_s, "every_s": a.every_s, "eval_prompts": a.eval_prompts,
              "eval_samples": a.eval_samples, "overrides": a.overrides, "runs": runs}
    (out / "rl_from_base.json").write_text(json.dumps(result, indent=1))
  table(result)
  plot(result, a.plot)


if __name__ == "__main__":
  main()
