"""Every training mode on the same long-tailed workload, side by side.

Each mode runs in fresh processes (same config, same wall-clock budget) on
one workload (``--workload``), in **interleaved rounds**: every round runs
every mode once, in an order shuffled per round, with ``config.seed`` = the
round's index. A mode's speed is read as its ratio to ``sync`` *of the same
round*, and the table gives the median and the min-max range of those
per-round ratios: this VM's speed drifts by up to 2x over twenty minutes, and
modes run one after another in a fixed order turned that drift into
"ratios" (12-04: dora_pace / async_unfiltered 0.76x in one pass, 0.95x in
the next).

* ``long_tail`` (default, ``configs/long_tail.py``): a rollout-dominated
  workload whose rollout lengths follow a power law fixed by the workload;
* ``long_context`` (``configs/long_context.py``): prompts of a few hundred
  tokens and answers up to 2k tokens, published often: the regime where
  AReaL-style interruption (``async_unfiltered``) re-prefills long prefixes
  after every publish and DORA does not.
* ``moe`` (``configs/long_tail_moe.py``): the long-tail workload with a
  mixture-of-experts policy (8 experts, top-2);
* ``math`` (``configs/tiny_math_dapo.py``): RL from the shipped base model on
  the word problems with DAPO's dynamic sampling (a rollout-dominated
  synchronous step: sync bubble 68% measured, 12-06); held-out pass@1;
* ``math_tools`` (``configs/tiny_math_tools.py``): the python tool on word
  problems whose last step needs it, from ``configs/tool_sft.py``'s model
  (run that SFT first); the tools modes and latency below;
* ``tools`` (``configs/tiny_tools.py``): multi-turn trajectories that call a
  calculator mid-generation (each call 0.1 s of environment latency by
  default); sync, async_unfiltered, dora and dora_pace; the table adds tool
  calls per trajectory.

The table reports, measured in this one run:

* trained tokens/s (completion tokens the learner consumed per second) and its
  ratio to ``sync``;
* learner bubble ratio (share of step time the learner waited for data);
* held-out reward at the end of the budget (512 prompts), mean over rounds
  with the standard error across rounds (seeds: training noise included),
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

Usage: python benchmarks/modes.py [--rounds 3] [--budget_s 40] [--modes sync,dora,...]
                                  [--workload long_tail|long_context]
                                  [--variant off: --variant on:--config.x=y ...]
                                  [--placement split|shared] [--json FILE]
                                  [--config.x=y ...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jax_dora.metrics.reward_curves import mean_se  # noqa: E402  pylint: disable=wrong-import-position
from _procs import free_port  # noqa: E402  pylint: disable=wrong-import-position

WORKLOADS = {"long_tail": "configs/long_tail.py", "long_context": "configs/long_context.py",
             "tools": "configs/tiny_tools.py", "moe": "configs/long_tail_moe.py",
             "math": "configs/tiny_math_dapo.py", "math_tools": "configs/tiny_math_tools.py"}
# Multi-turn workloads: the tools modes and the slow-environment latency below.
TOOL_WORKLOADS = ("tools", "math_tools")
# The multi-turn workload (issue 25): its modes, and a tool latency that
# models a slow environment: each call adds a long-tailed wait to its
# trajectory's wall time (Pareto, alpha 1.5, mean 0.3 s: the slowest of a
# 64-trajectory batch waits ~1.6 s), the tail a synchronous step waits for.
TOOLS_MODES = ("sync", "async_unfiltered", "dora", "dora_pace")
TOOLS_DEFAULT_OVERRIDES = ("--config.tools.extra_latency_s=0.3",
                           "--config.tools.latency_tail_alpha=1.5")
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


def split_cores() -> tuple[list[int], list[int]]:
  """(learner cores, rollout cores): disjoint halves of this process's cores."""
  cores = sorted(os.sched_getaffinity(0))
  if len(cores) < 2:
    raise SystemExit("--placement=split needs at least 2 CPU cores; use --placement=shared")
  half = len(cores) // 2
  return cores[:half], cores[half:]


def _wait_until_serving(proc: subprocess.Popen, log_path: pathlib.Path,
                        timeout_s: float = 600.0) -> None:
  """Blocks until the server logs that it serves (its programs compiled).

  The learner's clock starts after its own compilation; without this wait a
  server still compiling (a cold cache) was charged to the first steps of
  whichever mode ran, and the dispatcher's 10 s suspect period after the
  refused connection came on top.
  """
  deadline = time.time() + timeout_s
  while time.time() < deadline:
    if proc.poll() is not None:
      raise SystemExit(f"the rollout server exited with code {proc.returncode} before serving:"
                       f" see {log_path}")
    if "serving on" in log_path.read_text(errors="replace"):
      return
    time.sleep(0.25)
  raise SystemExit(f"the rollout server did not start serving within {timeout_s:.0f}s: see {log_path}")


@contextlib.contextmanager
def rollout_server(out: pathlib.Path, cores: list[int], extra: list[str]):
  """A gRPC rollout server process on ``cores``; yields its address."""
  port = free_port()
  log = open(out / "rollout_server.log", "w")
  proc = subprocess.Popen(
      [sys.executable, "-m", "jax_dora.rollout.server_main", f"--config={CONFIG}",
       f"--config.rollout.port={port}", f"--config.snapshots.directory={out / 'snapshots'}",
       # One server owns every rollout slot of the workload.
       "--config.rollout.slots=64", *extra],
      cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT, preexec_fn=_pin(cores))
  try:
    _wait_until_serving(proc, out / "rollout_server.log")
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
  # Learner steps per second of training time: with a fixed batch, trained
  # trajectories/s, the unit of a tool workload whose turns sample few tokens.
  summary["steps_per_s"] = summary["steps"] / max(summary.get("wall_time_s") or 0.0, 1e-9)
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
  per_traj = [r["tools/calls_per_trajectory"] for r in recs if "tools/calls_per_trajectory" in r]
  if per_traj:
    summary["tool_calls_per_trajectory"] = sum(per_traj) / len(per_traj)
  # Per trained trajectory (a step trains groups_per_step x group_size of them).
  cfg = json.loads((out / "config.json").read_text())
  trained = max(1, summary["steps"] * cfg["learner"]["groups_per_step"] * cfg["learner"]["group_size"])
  summary["reprefill_per_trajectory"] = summary["reprefill_tokens"] / trained
  if per_traj:
    # Trained turns/s (a turn: the first one plus one per tool call): trajectories/s
    # depends on how many calls the policy being trained makes, turns/s much less.
    batch = cfg["learner"]["groups_per_step"] * cfg["learner"]["group_size"]
    turns = sum(batch * (1.0 + r.get("tools/calls_per_trajectory", 0.0)) for r in recs)
    summary["turns_per_s"] = turns / max(summary.get("wall_time_s") or 0.0, 1e-9)
  summary["reward_drop"] = reward_drop([r["reward_mean"] for r in recs])
  # Multi-turn trajectories started over past the bound (orchestrator.restart_stale_turns).
  summary["stale_turn_restarts"] = last.get("tools/stale_turn_restarts_total", 0)
  summary["stale_evicted"] = last.get("stale_evicted_total", 0)
  summary["held_kv_resumed_turns"] = sum(r.get("held_kv/resumed_turns") or 0 for r in recs)
  summary["held_kv_reprefilled_turns"] = sum(r.get("held_kv/reprefilled_turns") or 0 for r in recs)
  # Remote servers: Generate bytes each way per trained trajectory (multi-turn deltas cut
  # them, rollout.resume_deltas) and the requests that went out as deltas.
  for key in ("request_bytes", "result_bytes", "sent_delta", "sent_full", "sent_base_missing"):
    summary[f"wire_{key}"] = sum(r.get(f"wire/{key}") or 0 for r in recs)
  summary["wire_bytes_per_trajectory"] = (
      summary["wire_request_bytes"] + summary["wire_result_bytes"]) / trained
  # Off-policy measures: the clipped share of ratios, and learner vs behaviour KL.
  for key, name in (("train/clip_frac", "clip_frac"), ("train/mismatch/kl_k3", "mismatch_kl")):
    vals = [r[key] for r in recs if r.get(key) is not None]
    summary[name] = sum(vals) / len(vals) if vals else float("nan")
  return summary


def reward_drop(rewards: list[float], window: int = 5) -> float:
  """The largest fall of the training reward (mean of ``window`` steps) below its best so far.

  A policy that reached its best and then collapsed (seen on the tools workload: reward 1.0 ->
  0.03 in five steps after ~30 steps with nothing to learn from) trains a different workload
  afterwards, which moves trajectories/s; this flags such a run.
  """
  best, drop = float("-inf"), 0.0
  for i in range(window, len(rewards) + 1):
    m = sum(rewards[i - window:i]) / window
    best = max(best, m)
    drop = max(drop, best - m)
  return drop


def ratio_spread(values: list[float]) -> dict:
  """Median, min, max and mean ± standard error of per-round values.

  The median and the range are what to quote: with a few rounds on a machine
  whose speed drifts, one slow round moves a mean but not a median.
  """
  vals = sorted(v for v in values if v == v)  # NaN-free
  if not vals:
    return {"median": float("nan"), "min": float("nan"), "max": float("nan"),
            "mean": float("nan"), "se": float("nan"), "n": 0}
  mean, se = mean_se(vals)
  return {"median": statistics.median(vals), "min": vals[0], "max": vals[-1],
          "mean": mean, "se": se, "n": len(vals)}


def aggregate_rounds(runs: dict[str, list[dict]], ref: str = "sync") -> dict[str, dict]:
  """One row per mode from its per-round summaries (``runs[mode][round]``).

  Each mode's tokens/s is divided by the reference mode's tokens/s *of the same
  round* before aggregating: the modes of a round ran within minutes of each
  other in shuffled order, so machine drift between rounds cancels in the
  ratio instead of landing on whichever mode happened to run in a slow spell.
  """
  rows = {}
  for mode, sums in runs.items():
    row = {"rounds": len(sums)}
    for key in ("steps", "trained_tokens_per_s", "bubble_ratio", "wasted_share",
                "mean_reward_last", "reprefill_tokens", "prefill_tokens",
                "prefill_tokens_computed", "reprefill_per_trajectory", "held_kv_resumed_turns",
                "held_kv_reprefilled_turns", "clip_frac", "mismatch_kl", "reward_drop",
                "wire_bytes_per_trajectory", "wire_sent_delta", "wire_sent_full",
                "wire_sent_base_missing", "stale_turn_restarts", "stale_evicted"):
      row[key] = statistics.mean(s.get(key) or 0.0 for s in sums)
    row["bubble"] = ratio_spread([s["bubble_ratio"] for s in sums])
    if ref in runs and len(runs[ref]) == len(sums):
      row["x_ref"] = ratio_spread([s["trained_tokens_per_s"] / max(r["trained_tokens_per_s"], 1e-9)
                                   for s, r in zip(sums, runs[ref])])
      row["x_ref_steps"] = ratio_spread([s["steps_per_s"] / max(r["steps_per_s"], 1e-9)
                                         for s, r in zip(sums, runs[ref])])
    evals = [s["final_eval_reward"] for s in sums if s.get("final_eval_reward") is not None]
    if evals:
      # Across rounds (each round has its own seed): training noise included.
      # One round: the eval's own sampling error.
      row["final_eval_reward"], se = mean_se(evals)
      row["final_eval_reward_stderr"] = se if len(evals) > 1 else sums[0].get(
          "final_eval_reward_stderr")
    row["integrity_violations"] = [v for s in sums for v in s.get("integrity_violations", [])]
    calls = [s["tool_calls_per_trajectory"] for s in sums if "tool_calls_per_trajectory" in s]
    if calls:
      row["tool_calls_per_trajectory"] = statistics.mean(calls)
    rows[mode] = row
  return rows


def versus_async_unfiltered(runs: dict[str, list[dict]], rows: dict[str, dict]) -> list[str]:
  """dora_pace's speed over async_unfiltered's, per round, into ``rows`` (and printable lines).

  Each dora_pace run (``dora_pace`` or ``dora_pace@VARIANT``) is compared with async_unfiltered
  under the same variant where that ran, else with its one run (``--variant_modes``).
  """
  lines = []
  for m in [k for k in runs if k.partition("@")[0] == "dora_pace"]:
    variant = m.partition("@")[2]
    ref = f"async_unfiltered@{variant}" if f"async_unfiltered@{variant}" in runs else "async_unfiltered"
    for key, unit in (("trained_tokens_per_s", "trained tokens/s"), ("steps_per_s", "trajectories/s"),
                      ("turns_per_s", "trained turns/s")):
      if ref not in runs or not all(key in s for s in runs[m] + runs[ref]):
        continue
      per_round = ratio_spread([d[key] / max(u[key], 1e-9) for d, u in zip(runs[m], runs[ref])])
      suffix = {"steps_per_s": "_steps", "turns_per_s": "_turns"}.get(key, "")
      rows[m]["x_async_unfiltered" + suffix] = per_round
      lines.append(f"{m} / {ref} {unit}: {_fmt_spread(per_round)}")
  return lines


def round_order(modes: list[str], rnd: int, seed: int) -> list[str]:
  """The modes of round ``rnd`` in a shuffled order (reproducible from ``seed``)."""
  order = list(modes)
  random.Random(seed * 1000 + rnd).shuffle(order)
  return order


def _fmt_spread(sp: dict | None, pct: bool = False) -> str:
  if not sp or not sp["n"]:
    return "n/a"
  f = (lambda v: f"{v:.0%}") if pct else (lambda v: f"{v:.2f}")
  if sp["n"] == 1:
    return f(sp["median"])
  return f"{f(sp['median'])} [{f(sp['min'])}-{f(sp['max'])}]"


def _or_nan(v: float | None) -> float:
  """A missing value prints as nan; a standard error of 0 (every seed agreed) as 0."""
  return float("nan") if v is None else v


def print_table(rows: dict[str, dict]) -> None:
  print(f"{'mode':<18}{'steps':>6}{'tok/s':>8}{'x sync [range]':>18}{'bubble [range]':>17}"
        f"{'wasted':>8}{'eval R':>8}{'± se':>7}{'train R':>8}{'re-prefill':>11}{'violations':>11}")
  for m, s in rows.items():
    ev = s.get("final_eval_reward")
    print(
        f"{m:<18}{s['steps']:>6.0f}{s['trained_tokens_per_s']:>8.0f}"
        f"{_fmt_spread(s.get('x_ref')):>18}{_fmt_spread(s['bubble'], pct=True):>17}"
        f"{s['wasted_share']:>8.1%}"
        f"{(ev if ev is not None else float('nan')):>8.3f}"
        f"{_or_nan(s.get('final_eval_reward_stderr')):>7.3f}"
        f"{s['mean_reward_last']:>8.3f}{s['reprefill_tokens']:>11.0f}"
        f"{len(s['integrity_violations']):>11}"
    )


def parse_variants(specs: list[str]) -> dict[str, list[str]]:
  """``--variant NAME:--config.x=y,--config.z=w`` arguments -> ``{NAME: [overrides]}``
  (this benchmark's and ``time_to_reward.py``'s); ValueError names a malformed one."""
  variants: dict[str, list[str]] = {}
  for spec in specs:
    name, _, extra = spec.partition(":")
    variants[name] = [o for o in extra.split(",") if o]
    if not name or any(not o.startswith("--config.") for o in variants[name]):
      raise ValueError(f"--variant {spec!r}: expected NAME:--config.x=y[,--config.z=w]")
  return variants


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--budget_s", type=float, default=40.0,
                  help="training wall-clock budget of one mode in one round")
  ap.add_argument("--rounds", type=int, default=3,
                  help="rounds; every mode runs once per round, in a shuffled order, with"
                       " config.seed = round index")
  ap.add_argument("--modes", default="", help="comma-separated (default: all six; the tools"
                  " workload: sync, async_unfiltered, dora, dora_pace)")
  ap.add_argument("--placement", choices=("split", "shared"), default="split",
                  help="split: learner and rollout on disjoint cores (default); shared: one process")
  ap.add_argument("--quick", action="store_true", help="short budget smoke run")
  ap.add_argument("--workload", choices=sorted(WORKLOADS), default="long_tail",
                  help="long_tail (configs/long_tail.py), long_context (configs/long_context.py),"
                       " tools (configs/tiny_tools.py, multi-turn), moe"
                       " (configs/long_tail_moe.py, a mixture-of-experts policy), math"
                       " (configs/tiny_math_dapo.py: RL from the shipped base model) or"
                       " math_tools (configs/tiny_math_tools.py: the python tool, from"
                       " configs/tool_sft.py's model)")
  ap.add_argument("--out", default="", help="directory for per-mode runs (default: temp)")
  ap.add_argument("--shuffle_seed", type=int, default=0, help="seeds the per-round mode order")
  ap.add_argument("--json", default="", help="also write the aggregated table here")
  ap.add_argument("--variant", action="append", default=[], metavar="NAME:--config.x=y,...",
                  help="run every mode once per variant (repeatable), interleaved in the same"
                       " rounds; the table adds each variant's tok/s over the first one's of the"
                       " same round (an A/B of a setting's cost, e.g. off: and"
                       " on:--config.audit.verify_fraction=0.02)")
  ap.add_argument("--variant_modes", default="",
                  help="comma-separated: only these modes run once per variant; the others run"
                       " once per round without the variants' overrides (default: every mode)")
  a, overrides = ap.parse_known_args()
  bad = [o for o in overrides if not o.startswith("--config.")]
  if bad:
    ap.error(f"unrecognized arguments {bad} (config overrides look like --config.x=y)")
  if a.rounds < 1:
    ap.error("--rounds must be >= 1")
  global CONFIG
  CONFIG = WORKLOADS[a.workload]
  budget = 20.0 if a.quick else a.budget_s
  base = pathlib.Path(a.out or tempfile.mkdtemp(prefix="jax_dora_modes_"))
  default_modes = TOOLS_MODES if a.workload in TOOL_WORKLOADS else ALL_MODES
  modes = [m for m in (a.modes or ",".join(default_modes)).split(",") if m]
  try:
    variants = parse_variants(a.variant)
  except ValueError as e:
    ap.error(str(e))
  if variants:  # one entry per mode and variant: "dora_pace@on"
    varied = set(a.variant_modes.split(",")) if a.variant_modes else set(modes)
    modes = [f"{m}@{name}" if m in varied else m for m in modes
             for name in (variants if m in varied else [""])]
  if a.workload in TOOL_WORKLOADS:
    given = {o.split("=", 1)[0] for o in overrides}
    overrides = [o for o in TOOLS_DEFAULT_OVERRIDES if o.split("=", 1)[0] not in given] + overrides
  where = a.placement
  if where == "split":
    learner_cores, rollout_cores = split_cores()
    where += f" (learner cores {learner_cores}, rollout cores {rollout_cores})"
  print(f"workload {CONFIG} {' '.join(overrides)}; placement {where}; {a.rounds} round(s) of"
        f" {budget:.0f}s per mode, order shuffled per round", flush=True)
  runs: dict[str, list[dict]] = {m: [] for m in modes}
  for rnd in range(a.rounds):
    order = round_order(modes, rnd, a.shuffle_seed)
    print(f"round {rnd + 1}/{a.rounds}: {', '.join(order)}", flush=True)
    for m in order:
      mode, _, variant = m.partition("@")
      s = run_mode(mode, base / f"round{rnd}" / m, budget,
                   overrides + variants.get(variant, []) + [f"--config.seed={rnd}"], a.placement)
      runs[m].append(s)
      calls = (f"  {s['tool_calls_per_trajectory']:.2f} calls/trajectory"
               if "tool_calls_per_trajectory" in s else "")
      print(f"  {m:<17} {s['steps']:>4} steps {s['trained_tokens_per_s']:>7.0f} tok/s"
            f"  bubble {s['bubble_ratio']:.0%}{calls}  train reward fell {s['reward_drop']:.2f}"
            " below its best", flush=True)
  rows = aggregate_rounds(runs)
  print()
  print_table(rows)
  print("\n[range]: min-max over rounds of the per-round value (x sync: the mode's tok/s over"
        " sync's in the same round); eval R ± se: across rounds (seeds)")
  computed = [s for s in rows.values() if s.get("prefill_tokens_computed")]
  if computed:
    asked = sum(s["prefill_tokens"] for s in computed)
    done = sum(s["prefill_tokens_computed"] for s in computed)
    print(f"prefill: {asked:.0f} context tokens admitted, {done:.0f} computed (group prefix sharing:"
          f" {asked / done:.1f}x less prompt work)")
  for line in versus_async_unfiltered(runs, rows):
    print(line)
  names = list(variants)
  for m in dict.fromkeys(k.partition("@")[0] for k in runs if "@" in k) if len(names) > 1 else ():
    first = runs[f"{m}@{names[0]}"]
    for name in names[1:]:
      per_round = ratio_spread([v["trained_tokens_per_s"] / max(f["trained_tokens_per_s"], 1e-9)
                                for v, f in zip(runs[f"{m}@{name}"], first)])
      rows[f"{m}@{name}"][f"x_{names[0]}"] = per_round
      print(f"{m}: {name} / {names[0]} trained tokens/s: {_fmt_spread(per_round)}")
  for m, s in rows.items():
    if s.get("tool_calls_per_trajectory") is not None:
      print(f"{m}: {s['tool_calls_per_trajectory']:.2f} tool calls per trained trajectory,"
            f" trained trajectories/s x sync {_fmt_spread(s.get('x_ref_steps'))},"
            f" re-prefilled {s['reprefill_per_trajectory']:.1f} tokens per trained trajectory"
            f" (held-KV turns {s['held_kv_resumed_turns']:.0f} resumed,"
            f" {s['held_kv_reprefilled_turns']:.0f} re-prefilled), clipped"
            f" {s['clip_frac']:.2%}, mismatch kl {s['mismatch_kl']:.1e}, Generate"
            f" {s['wire_bytes_per_trajectory'] / 1024:.1f} KiB per trained trajectory"
            f" (requests: {s['wire_sent_full']:.0f} full, {s['wire_sent_delta']:.0f} deltas,"
            f" {s['wire_sent_base_missing']:.0f} resent after a missing base), groups evicted"
            f" as stale {s['stale_evicted']:.0f}, trajectories restarted past the bound at a turn"
            f" boundary {s['stale_turn_restarts']:.0f}")
  if "sync" in rows:
    print(f"\nsync spends {_fmt_spread(rows['sync']['bubble'], pct=True)} of its step waiting for"
          " rollout (the learner's bubble is exactly the rollout share there).")
  if a.json:
    pathlib.Path(a.json).write_text(json.dumps(
        {"workload": CONFIG, "overrides": overrides, "rounds": a.rounds, "budget_s": budget,
         "placement": where, "date": time.strftime("%Y-%m-%d %H:%M"), "modes": rows,
         "per_round": runs}, indent=1, default=str))
  print(f"runs in {base}; plot with: python scripts/plot_metrics.py {base}/round0/*/metrics.jsonl"
        " -o modes.png")


if __name__ == "__main__":
  main()
