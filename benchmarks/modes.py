"""Every training mode on the same long-tailed workload, side by side.

Each mode runs in fresh processes (same seed, same config, same wall-clock
budget) on one workload (``--workload``):

* ``long_tail`` (default, ``configs/long_tail.py``): a rollout-dominated
  workload whose rollout lengths follow a power law fixed by the workload;
* ``long_context`` (``configs/long_context.py``): prompts of a few hundred
  tokens and answers up to 2k tokens, published often: the regime where
  AReaL-style interruption (``async_unfiltered``) re-prefills long prefixes
  after every publish and DORA does not.

The table reports, measured in this one run:

* trained tokens/s (completion tokens the learner consumed per second) and its
  ratio to ``sync``;
* learner bubble ratio (share of step time the learner waited for data);
* held-out reward at the end of the budget (512 prompts) with its standard
  error (a difference between modes smaller than about twice that is noise),
  and the mean training reward of the last steps;
* rollout tokens wasted (generated but never trained: evicted as stale,
  rejected by PACE, or still in flight at the end);
* re-prefilled tokens (resumed prompt + completion prefixes the servers
  computed again after an interruption; only ``async_unfiltered`` and
  ``partial_rollout`` pay them) and the prefill tokens group prefix sharing
  saved;
* integrity violations found in the trained-sample log (must be 0).

Placement (``--placement``):

* ``split`` (default): the deployment shape on a CPU. Learner and rollout
  get *disjoint CPU cores*, the way they get disjoint accelerators on a pod:
  the rollout server is a separate process (the real gRPC server mode,
  ``jax_dora.rollout.server_main``) pinned to half the cores, the learner
  (``jax_dora.train`` with ``rollout.server_addresses``) to the other half;
  they exchange Orbax snapshots through the run's directory.
* ``shared``: learner and embedded rollout servers in one process on forced
  host devices that share every core. Overlapping rollout with training
  cannot buy compute there, so this placement measures only what DORA saves
  in rollout work (no tail waste), not the bubble it removes.

Usage: python benchmarks/modes.py [--budget_s 60] [--modes sync,dora,...]
                                  [--workload long_tail|long_context]
                                  [--placement split|shared] [--seeds N]
                                  [--config.x=y ...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKLOADS = {"long_tail": "configs/long_tail.py", "long_context": "configs/long_context.py"}
CONFIG = WORKLOADS["long_tail"]  # set by --workload
ALL_MODES = ("sync", "one_step_off", "partial_rollout", "async_unfiltered", "dora", "dora_pace")


def _env() -> dict[str, str]:
  env = dict(os.environ)
  env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  env.setdefault("JAX_PLATFORMS", "cpu")
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  # Every run compiles the same programs (identical shapes): JAX's persistent
  # cache lets the runs after the first load them instead of paying minutes
  # of start-up each. Timing is unaffected: the budget starts after compiles.
  env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "jax_dora_xla_cache"))
  return env


def _pin(cores: list[int]):
  """preexec_fn pinning the child process (and all its threads) to ``cores``."""
  return lambda: os.sched_setaffinity(0, cores)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def split_cores() -> tuple[list[int], list[int]]:
  """(learner cores, rollout cores): disjoint halves of this process's cores."""
  cores = sorted(os.sched_getaffinity(0))
  if len(cores) < 2:
    raise SystemExit("--placement=split needs at least 2 CPU cores; use --placement=shared")
  half = len(cores) // 2
  return cores[:half], cores[half:]


@contextlib.contextmanager
def rollout_server(out: pathlib.Path, cores: list[int], extra: list[str]):
  """A gRPC rollout server process on ``cores``; yields its address."""
  port = _free_port()
  log = open(out / "rollout_server.log", "w")
  proc = subprocess.Popen(
      [sys.executable, "-m", "jax_dora.rollout.server_main", f"--config={CONFIG}",
       f"--config.rollout.port={port}", f"--config.snapshots.directory={out / 'snapshots'}",
       # One server owns every rollout slot of the workload.
       "--config.rollout.slots=64", *extra],
      cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT, preexec_fn=_pin(cores))
  try:
    yield f"localhost:{port}"
  finally:
    proc.send_signal(signal.SIGTERM)
    try:
      proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
      proc.kill()
    log.close()


def run_mode(mode: str, out: pathlib.Path, budget_s: float, extra: list[str], placement: str) -> dict:
  out.mkdir(parents=True, exist_ok=True)
  args = [
      sys.executable, "-m", "jax_dora.train", f"--config={CONFIG}",
      f"--config.mode={mode}",
      f"--config.output_dir={out}",
      f"--config.max_wall_time_s={budget_s}",
      "--config.total_steps=100000",
      "--config.progress_bar=False",
      "--config.checkpoint.resume=False",
      # Held-out reward only at the start and after the budget: a periodic
      # eval blocks the learner, and would tax faster modes more often.
      "--config.eval.every_steps=0",
      *extra,
  ]
  t0 = time.time()
  with contextlib.ExitStack() as stack:
    preexec = None
    if placement == "split":
      learner_cores, rollout_cores = split_cores()
      address = stack.enter_context(rollout_server(out, rollout_cores, extra))
      args += [f"--config.rollout.server_addresses={address}", "--config.role=learner",
               f"--config.snapshots.directory={out / 'snapshots'}"]
      preexec = _pin(learner_cores)
    proc = subprocess.run(args, cwd=ROOT, env=_env(), capture_output=True, text=True,
                          preexec_fn=preexec)
  (out / "train.log").write_text(proc.stderr)
  if proc.returncode not in (0, 3):
    sys.stderr.write(proc.stderr[-4000:])
    raise SystemExit(f"mode {mode} failed with exit code {proc.returncode}")
  summary = json.loads((out / "summary.json").read_text())
  recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if l.strip()]
  wait = sum(r["learner_wait_s"] for r in recs[1:])  # step 1 includes the first fill
  busy = sum(r["learner_train_s"] + r["publish_s"] for r in recs[1:])
  summary["bubble_ratio"] = wait / max(wait + busy, 1e-9)
  summary["process_s"] = time.time() - t0
  summary["mean_reward_last"] = (
      sum(r["reward_mean"] for r in recs[-10:]) / max(len(recs[-10:]), 1) if recs else float("nan")
  )
  last = recs[-1] if recs else {}
  generated = last.get("generated_tokens_per_s", 0.0) * last.get("wall_time_s", 0.0)
  trained = last.get("trained_tokens_per_s", 0.0) * last.get("wall_time_s", 0.0)
  summary["wasted_share"] = 1.0 - trained / generated if generated else float("nan")
  summary["reprefill_tokens"] = sum(r.get("reprefill_tokens") or 0 for r in recs)
  summary["prefill_tokens"] = sum(r.get("prefill_tokens") or 0 for r in recs)
  summary["prefill_tokens_computed"] = sum(r.get("prefill_tokens_computed") or 0 for r in recs)
  return summary


def _mean_over_seeds(summaries: list[dict]) -> dict:
  """One row from a mode's runs: means; eval R's error is across seeds when
  there are several (training noise included), else the eval's own."""
  if len(summaries) == 1:
    return summaries[0]
  row = dict(summaries[0])
  for key in ("steps", "trained_tokens_per_s", "bubble_ratio", "wasted_share", "mean_reward_last",
              "reprefill_tokens"):
    row[key] = statistics.mean(s[key] for s in summaries)
  row["steps"] = round(row["steps"])
  evals = [s["final_eval_reward"] for s in summaries if s.get("final_eval_reward") is not None]
  if evals:
    row["final_eval_reward"] = statistics.mean(evals)
    row["final_eval_reward_stderr"] = (
        statistics.stdev(evals) / len(evals) ** 0.5 if len(evals) > 1 else None)
  row["integrity_violations"] = [v for s in summaries for v in s["integrity_violations"]]
  return row


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--budget_s", type=float, default=60.0, help="training wall-clock budget per mode")
  ap.add_argument("--modes", default=",".join(ALL_MODES))
  ap.add_argument("--placement", choices=("split", "shared"), default="split",
                  help="split: learner and rollout on disjoint cores (default); shared: one process")
  ap.add_argument("--quick", action="store_true", help="short budget smoke run")
  ap.add_argument("--workload", choices=sorted(WORKLOADS), default="long_tail",
                  help="long_tail (configs/long_tail.py) or long_context (configs/long_context.py)")
  ap.add_argument("--out", default="", help="directory for per-mode runs (default: temp)")
  ap.add_argument("--seeds", type=int, default=1,
                  help="runs per mode (config.seed 0..N-1); the table shows means and, for eval R,"
                       " the standard error across seeds, which includes training noise")
  a, overrides = ap.parse_known_args()
  bad = [o for o in overrides if not o.startswith("--config.")]
  if bad:
    ap.error(f"unrecognized arguments {bad} (config overrides look like --config.x=y)")
  global CONFIG
  CONFIG = WORKLOADS[a.workload]
  budget = 25.0 if a.quick else a.budget_s
  base = pathlib.Path(a.out or tempfile.mkdtemp(prefix="jax_dora_modes_"))
  modes = [m for m in a.modes.split(",") if m]
  where = a.placement
  if where == "split":
    learner_cores, rollout_cores = split_cores()
    where += f" (learner cores {learner_cores}, rollout cores {rollout_cores})"
  print(f"workload {CONFIG} {' '.join(overrides)}; placement {where}", flush=True)
  runs: dict[str, list[dict]] = {m: [] for m in modes}
  for seed in range(a.seeds):
    for m in modes:
      tag = f" (seed {seed})" if a.seeds > 1 else ""
      print(f"running {m}{tag} for {budget:.0f}s ...", flush=True)
      out = base / m if a.seeds == 1 else base / f"{m}_seed{seed}"
      runs[m].append(run_mode(m, out, budget, overrides + [f"--config.seed={seed}"], a.placement))
  results = {m: _mean_over_seeds(r) for m, r in runs.items()}
  ref = results.get("sync", {}).get("trained_tokens_per_s")
  print()
  print(f"{'mode':<18}{'steps':>6}{'tok/s':>9}{'x sync':>8}{'bubble':>8}{'wasted':>8}"
        f"{'eval R':>8}{'± se':>7}{'train R':>8}{'re-prefill':>11}{'violations':>11}")
  for m, s in results.items():
    ratio = s["trained_tokens_per_s"] / ref if ref else float("nan")
    ev = s.get("final_eval_reward")
    print(
        f"{m:<18}{s['steps']:>6}{s['trained_tokens_per_s']:>9.1f}{ratio:>8.2f}"
        f"{s['bubble_ratio']:>8.1%}{s['wasted_share']:>8.1%}"
        f"{(ev if ev is not None else float('nan')):>8.3f}"
        f"{(s.get('final_eval_reward_stderr') or float('nan')):>7.3f}"
        f"{s['mean_reward_last']:>8.3f}{s['reprefill_tokens']:>11.0f}"
        f"{len(s['integrity_violations']):>11}"
    )
  shared = [s for s in results.values() if s.get("prefill_tokens_computed")]
  if shared:
    asked = sum(s["prefill_tokens"] for s in shared)
    done = sum(s["prefill_tokens_computed"] for s in shared)
    print(f"\nprefill: {asked} context tokens admitted, {done} computed (group prefix sharing:"
          f" {asked / done:.1f}x less prompt work)")
  ref_mode = "async_unfiltered" if "async_unfiltered" in results else None
  if ref_mode and "dora_pace" in results:
    a_u, d_p = results[ref_mode], results["dora_pace"]
    print(f"dora_pace / async_unfiltered trained tokens/s: "
          f"{d_p['trained_tokens_per_s'] / max(a_u['trained_tokens_per_s'], 1e-9):.2f}x")
  if "sync" in results:
    print(f"\nsync spends {results['sync']['bubble_ratio']:.0%} of its step waiting for rollout"
          " (the learner's bubble is exactly the rollout share there).")
  print(f"runs in {base}; plot with: python scripts/plot_metrics.py {base}/*/metrics.jsonl -o modes.png")


if __name__ == "__main__":
  main()
