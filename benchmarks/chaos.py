"""Chaos run: dora_pace training while rollout servers and the learner are abused.

Starts ``--servers`` gRPC rollout server processes and a learner process
(``jax_dora.train``, ``dora_pace``, remote rollout, run checkpoints every
``--checkpoint-every`` steps), then, every ``--interval`` seconds, does one of:

* ``kill``: SIGKILL a rollout server, restart it at the same address after
  ``--restart-after`` seconds (the dispatcher must re-issue its requests and
  re-admit the new process);
* ``stop``: SIGSTOP a rollout server for ``--stop-seconds`` (default 130: past
  the old fixed 120 s request deadline), then SIGCONT (liveness must be
  judged by health/progress, its requests re-issued elsewhere meanwhile);
* ``learner``: SIGKILL the learner and start it again, resuming from its last
  run checkpoint while the servers stay up (run incarnations).

When the learner has finished ``--steps`` steps, the trained-sample log of
the whole run (all incarnations) is audited and the script prints samples
drawn / trained / dropped with reason / pending / lost / duplicated and
staleness violations. Exit status 1 if any of lost, duplicated or violations
is non-zero.

  python benchmarks/chaos.py                       # a few minutes, defaults
  python benchmarks/chaos.py --steps 12 --stop-seconds 8 --interval 6   # short
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jax_dora.orchestrator.integrity import IntegrityLedger, read_log  # pylint: disable=wrong-import-position
from _procs import free_port  # noqa: E402  pylint: disable=wrong-import-position

_MODEL = dict(d_model=32, n_layers=1, n_heads=2, d_ff=64)


def _env() -> dict[str, str]:
  return dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1",
              XLA_FLAGS="--xla_force_host_platform_device_count=4")


class Server:
  """One rollout server process, restartable at the same port."""

  def __init__(self, i: int, port: int, snapshots: pathlib.Path, logs: pathlib.Path,
               extra: list[str]):
    self.i, self.port, self.snapshots, self.logs, self.extra = i, port, snapshots, logs, extra
    self.proc: subprocess.Popen | None = None
    self.starts = 0
    self.stopped_until = 0.0

  def start(self) -> None:
    self.starts += 1
    log = open(self.logs / f"server{self.i}.{self.starts}.log", "wb")
    self.proc = subprocess.Popen(
        [sys.executable, "-m", "jax_dora.rollout.server_main", "--config=configs/tiny.py",
         "--config.precompile=False",
         "--host=127.0.0.1", "--grace_s=1", f"--config.rollout.port={self.port}",
         f"--config.snapshots.directory={self.snapshots}", "--config.rollout.slots=8",
         *[f"--config.model.{k}={v}" for k, v in _MODEL.items()], *self.extra],
        cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT)

  def log_tail(self, lines: int = 5) -> str:
    """The last lines of this incarnation's log, to say why it died."""
    path = self.logs / f"server{self.i}.{self.starts}.log"
    text = path.read_text(errors="replace") if path.exists() else ""
    return " | ".join(text.strip().splitlines()[-lines:])

  @property
  def address(self) -> str:
    return f"127.0.0.1:{self.port}"

  def alive(self) -> bool:
    return self.proc is not None and self.proc.poll() is None

  def signal(self, sig: int) -> None:
    if self.alive():
      self.proc.send_signal(sig)

  def close(self) -> None:
    if self.proc is None:
      return
    if self.stopped_until:
      self.signal(signal.SIGCONT)
    self.signal(signal.SIGTERM)
    try:
      self.proc.wait(20)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      self.proc.wait(10)


class Learner:
  """The training process; killed and resumed on demand."""

  def __init__(self, args: argparse.Namespace, out: pathlib.Path, snapshots: pathlib.Path,
               addresses: str, logs: pathlib.Path):
    self.args, self.out, self.logs = args, out, logs
    self.cmd = [
        sys.executable, "-m", "jax_dora.train", "--config=configs/tiny.py",
        "--config.precompile=False",
        "--config.mode=dora_pace", f"--config.output_dir={out}",
        f"--config.snapshots.directory={snapshots}", f"--config.total_steps={args.steps}",
        "--config.role=learner", f"--config.rollout.server_addresses={addresses}",
        f"--config.checkpoint.every_steps={args.checkpoint_every}",
        "--config.progress_bar=False", "--config.eval.num_prompts=0",
        "--config.eval.at_start=False", "--config.learner.groups_per_step=4",
        "--config.learner.group_size=4", "--config.learner.num_devices=2",
        f"--config.orchestrator.max_staleness={args.max_staleness}",
        "--config.orchestrator.max_server_restarts=1000",
        *[f"--config.model.{k}={v}" for k, v in _MODEL.items()], *args.learner_arg,
    ]
    self.proc: subprocess.Popen | None = None
    self.starts = 0

  def start(self) -> None:
    self.starts += 1
    log = open(self.logs / f"learner.{self.starts}.log", "wb")
    self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=_env(), stdout=log,
                                 stderr=subprocess.STDOUT)

  def steps_logged(self) -> int:
    path = self.out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def audit(out: pathlib.Path, max_staleness: int, group_size: int) -> dict[str, Any]:
  """What happened to every drawn sample, from the run's own logs."""
  summary = json.loads((out / "summary.json").read_text())
  records = read_log(out / "trained_samples.jsonl")
  trained_keys = collections.Counter(
      (r["sample_id"], r["member"]) for r in records if r["event"] == "trained")
  trained_ids = {sid for sid, _ in trained_keys}
  dropped = collections.Counter()
  dropped_ids: set[int] = set()
  for r in records:
    if r["event"] == "rejected" and not r["regenerate"]:
      dropped[r["reason"]] += 1
      dropped_ids.add(r["sample_id"])
  starts = [i for i, r in enumerate(records) if r["event"] == "run_start"]
  last_run = records[starts[-1]:] if starts else records
  pending_ids = {r["sample_id"] for r in last_run if r["event"] == "pending"}
  drawn = int(summary["samples_drawn"])
  accounted = trained_ids | dropped_ids | pending_ids
  lost = sorted(set(range(drawn)) - accounted)
  stray = sorted(accounted - set(range(drawn)))
  partial_groups = sorted(sid for sid in trained_ids
                          if sum(trained_keys[(sid, m)] for m in range(group_size)) < group_size)
  stale = [r for r in records if r["event"] == "trained"
           and r["learner_version"] - min(s[2] for s in r["spans"]) > max_staleness]
  ledger = IntegrityLedger.from_log(out / "trained_samples.jsonl", group_size=group_size,
                                    max_staleness=max_staleness)
  return {
      "samples_drawn": drawn,
      "trained": len(trained_ids),
      "dropped": dict(dropped),
      "pending": len(pending_ids),
      "lost": len(lost) + len(stray) + len(partial_groups),
      "duplicated": sum(n - 1 for n in trained_keys.values() if n > 1),
      "staleness_violations": len(stale),
      "audit_violations": ledger.check() + list(summary["integrity_violations"]),
      "steps": summary["steps"],
      "lost_ids": (lost + stray + partial_groups)[:20],
  }


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--steps", type=int, default=40)
  ap.add_argument("--servers", type=int, default=2)
  ap.add_argument("--interval", type=float, default=15.0, help="seconds between chaos events")
  ap.add_argument("--interval-steps", type=int, default=0,
                  help="also wait this many learner steps between events, so a fixed schedule"
                       " lands inside the run however fast the learner is (0 = time only)")
  ap.add_argument("--stop-seconds", type=float, default=130.0)
  ap.add_argument("--restart-after", type=float, default=3.0)
  ap.add_argument("--learner-kills", type=int, default=2)
  ap.add_argument("--checkpoint-every", type=int, default=2)
  ap.add_argument("--max-staleness", type=int, default=2)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--schedule", default="",
                  help="fixed comma-separated events (kill,stop,learner) instead of random ones")
  ap.add_argument("--timeout", type=float, default=1800.0, help="give up after this many seconds")
  ap.add_argument("--out", default="", help="run directory (default: a temporary one)")
  ap.add_argument("--learner-arg", action="append", default=[],
                  help="extra --config.x=y for the learner (repeatable)")
  ap.add_argument("--server-arg", action="append", default=[],
                  help="extra --config.x=y for the servers (repeatable)")
  args = ap.parse_args()
  rng = random.Random(args.seed)
  base = pathlib.Path(args.out or tempfile.mkdtemp(prefix="jax_dora_chaos_"))
  out, snapshots, logs = base / "run", base / "snapshots", base / "logs"
  logs.mkdir(parents=True, exist_ok=True)
  servers = [Server(i, free_port(), snapshots, logs, args.server_arg) for i in range(args.servers)]
  for s in servers:
    s.start()
  learner = Learner(args, out, snapshots, ",".join(s.address for s in servers), logs)
  events: collections.Counter[str] = collections.Counter()
  t0 = time.time()
  restarts: list[tuple[float, Server]] = []
  unplanned: list[str] = []
  schedule = [e for e in args.schedule.split(",") if e]
  scheduled = bool(schedule)
  if any(e not in ("kill", "stop", "learner") for e in schedule):
    ap.error(f"--schedule takes kill, stop and learner events, got {args.schedule!r}")
  try:
    learner.start()
    next_event = time.time() + args.interval
    next_step = 1  # events start once the learner has logged a step
    while True:
      now = time.time()
      if now - t0 > args.timeout:
        print(f"timed out after {args.timeout:.0f}s; logs in {logs}", file=sys.stderr)
        return 2
      for s in servers:  # SIGCONT after the stop period
        if s.stopped_until and now >= s.stopped_until:
          s.signal(signal.SIGCONT)
          s.stopped_until = 0.0
      for when, s in list(restarts):
        if now >= when:
          s.start()
          restarts.remove((when, s))
      for s in servers:  # a server that died without being killed is a failure to report
        if not s.alive() and all(v is not s for _, v in restarts):
          unplanned.append(f"server{s.i} start {s.starts} exited with {s.proc.returncode}:"
                           f" {s.log_tail()}")
          print(f"[{now - t0:6.1f}s] UNPLANNED EXIT of server{s.i} (code {s.proc.returncode});"
                " restarting it", flush=True)
          s.start()
      code = learner.proc.poll()
      if code is not None:
        if code != 0:
          print(f"learner exited with {code}; logs in {logs}", file=sys.stderr)
          return 2
        if schedule:
          # A fixed schedule is the point of the run: say so rather than audit a
          # run that missed some of its events (the learner outran them).
          print(f"the learner finished {learner.steps_logged()} steps before the schedule's"
                f" last events {schedule} could be delivered (delivered {dict(events)};"
                f" servers alive {[s.alive() for s in servers]}, unplanned exits {unplanned});"
                f" raise --steps; logs in {logs}", file=sys.stderr)
          return 3
        break
      if now >= next_event and learner.steps_logged() >= next_step:
        next_event = now + args.interval
        if scheduled:
          if not schedule:
            continue  # the fixed schedule is done: let the learner finish
          what = schedule[0]
        else:
          choices = ["kill", "stop"] + (
              ["learner"] if events["learner"] < args.learner_kills else [])
          what = rng.choice(choices)
        idle = [s for s in servers if s.alive() and not s.stopped_until]
        if what == "learner":
          learner.proc.send_signal(signal.SIGKILL)
          learner.proc.wait(30)
          learner.start()
        elif what == "kill" and len(idle) > 1:
          victim = rng.choice(idle)
          victim.signal(signal.SIGKILL)
          victim.proc.wait(30)
          restarts.append((now + args.restart_after, victim))
        elif what == "stop" and len(idle) > 1:
          victim = rng.choice(idle)
          victim.signal(signal.SIGSTOP)
          victim.stopped_until = now + args.stop_seconds
        else:
          continue
        if schedule:
          schedule.pop(0)
        next_step = max(1, learner.steps_logged() + args.interval_steps)
        events[what] += 1
        print(f"[{now - t0:6.1f}s] {what} (learner at step {learner.steps_logged()})", flush=True)
      time.sleep(0.2)
  finally:
    if learner.proc is not None and learner.proc.poll() is None:
      learner.proc.kill()
    for s in servers:
      s.close()
  report = audit(out, args.max_staleness, group_size=4)
  print(f"chaos: {dict(events)} over {time.time() - t0:.0f}s, learner started {learner.starts}"
        f" times, servers started {[s.starts for s in servers]} times")
  for k in ("steps", "samples_drawn", "trained", "dropped", "pending", "lost", "duplicated",
            "staleness_violations"):
    print(f"  {k:22s} {report[k]}")
  print(f"  {'audit_violations':22s} {len(report['audit_violations'])}")
  for v in report["audit_violations"][:10]:
    print(f"    {v}")
  if report["lost_ids"]:
    print(f"  lost sample ids: {report['lost_ids']}")
  for u in unplanned:
    print(f"  unplanned exit: {u}")
  bad = report["lost"] or report["duplicated"] or report["staleness_violations"] or report[
      "audit_violations"] or unplanned
  print("RESULT", "FAIL" if bad else "OK", json.dumps({k: report[k] for k in (
      "samples_drawn", "trained", "pending", "lost", "duplicated", "staleness_violations")}))
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
