"""Orchestrator: every mode keeps the three DORA constraints, also under faults.

All checks are re-derived from the trained-sample log on disk (the audit a
user would run), with real embedded JetStream-engine servers on devices
disjoint from the learner mesh, real Orbax snapshots and a real learner.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from jax_dora.config import MODES, base_config
from jax_dora.orchestrator.dispatch import NoLiveServersError
from jax_dora.metrics.jsonl import read_metrics
from jax_dora.orchestrator.integrity import IntegrityLedger, read_log
from jax_dora.runtime import run_training

ROOT = pathlib.Path(__file__).resolve().parents[1]
MULTI_VERSION_MODES = ("partial_rollout", "async_unfiltered")


def small_config(tmp_path, mode, **overrides):
  cfg = base_config()
  cfg.mode = mode
  cfg.output_dir = str(tmp_path / mode)
  cfg.total_steps = 5
  cfg.progress_bar = False
  cfg.eval.num_prompts = 0
  cfg.eval.at_start = False
  cfg.learner.groups_per_step = 4
  cfg.learner.group_size = 4
  cfg.rollout.slots = 8
  cfg.audit.verify_fraction = 1.0  # every trained trajectory's labels and reward re-derived
  cfg.audit.label_time_share = 1.0
  for k, v in overrides.items():
    node = cfg
    *path, last = k.split(".")
    for p in path:
      node = node[p]
    node[last] = v
  return cfg


def audit(cfg) -> IntegrityLedger:
  ledger = IntegrityLedger.from_log(
      pathlib.Path(cfg.output_dir) / "trained_samples.jsonl",
      group_size=cfg.learner.group_size,
      max_staleness=cfg.orchestrator.max_staleness,
      allow_multi_version=cfg.mode in MULTI_VERSION_MODES,
  )
  assert ledger.check() == []
  return ledger


# Every mode runs in the default suite through another test as well (sync: unit
# ratios + dynamic sampling, and the learning e2e test; one_step_off: exact
# staleness; partial_rollout: a server killed mid-run; async_unfiltered: eval under
# aborts; dora: fixed answer lengths + background publishing, the loss options, and
# the recovery test; dora_pace: chaos and the multi-process runs), each with this
# same audit, so this sweep is `slow` (20 s to a minute per mode on 2 cores).
_COVERED_ELSEWHERE = MODES


@pytest.mark.parametrize("mode", [
    pytest.param(m, marks=pytest.mark.slow) if m in _COVERED_ELSEWHERE else m for m in MODES])
def test_every_mode_keeps_the_constraints(tmp_path, mode):
  cfg = small_config(tmp_path, mode)
  summary = run_training(cfg)
  assert summary["steps"] == cfg.total_steps
  assert summary["integrity_violations"] == []
  ledger = audit(cfg)
  trained = ledger.trained_records()
  assert len(trained) == cfg.total_steps * 16
  # A clean run's re-derived data: every label and reward checked, none wrong.
  labelled = sum(len({s[2] for s in r["spans"]}) for r in trained)
  assert summary["audit"]["labels_checked"] + summary["audit"]["labels_unverifiable"] == labelled
  assert summary["audit"]["labels_skipped"] == 0
  assert summary["audit"]["rewards_rescored"] == len(trained)
  keys = [(r["sample_id"], r["member"]) for r in trained]
  assert len(set(keys)) == len(keys)
  for r in trained:
    versions = {s[2] for s in r["spans"]}
    assert r["learner_version"] - min(versions) <= cfg.orchestrator.max_staleness
    if mode not in MULTI_VERSION_MODES:
      assert len(versions) == 1  # intra-trajectory policy consistency
  if mode in ("dora", "dora_pace", "async_unfiltered"):
    # Streaming really trained off-policy data (the bound was exercised).
    assert max(r["learner_version"] - min(s[2] for s in r["spans"]) for r in trained) >= 1


@pytest.mark.parametrize(
    "mode,seed,max_staleness,max_new_tokens,servers",
    [
        # A killed server in the streaming modes is also covered by default by
        # test_chaos.py (dora_pace, remote servers killed and stopped) and
        # test_server_health.py; these three are `slow`.
        pytest.param("dora", 1, 1, 24, 2, marks=pytest.mark.slow),
        pytest.param("dora_pace", 2, 2, 56, 2, marks=pytest.mark.slow),
        pytest.param("async_unfiltered", 3, 1, 40, 2, marks=pytest.mark.slow),
        ("partial_rollout", 4, 2, 56, 2),
    ],
)
def test_random_workloads_with_a_server_killed_mid_run(
    tmp_path, mode, seed, max_staleness, max_new_tokens, servers
):
  """A rollout server dies after step 2: its requests are re-issued, none lost."""
  cfg = small_config(
      tmp_path, mode, seed=seed, total_steps=6,
      **{"orchestrator.max_staleness": max_staleness, "rollout.max_new_tokens": max_new_tokens,
         "data.max_answer_len": max_new_tokens - 1, "rollout.num_servers": servers},
  )
  killed = []

  async def kill_one(rec, orch):
    if rec["step"] == 2 and not killed:
      victim = orch.dispatcher.live_clients[0]
      killed.append(victim.name)
      victim.driver.stop()  # in-flight requests fail with RolloutError

  summary = run_training(cfg, after_step=kill_one)
  assert killed and summary["steps"] == 6
  assert summary["integrity_violations"] == []
  audit(cfg)
  events = read_log(pathlib.Path(cfg.output_dir) / "trained_samples.jsonl")
  assert any(e["event"] == "reissued" for e in events), "the kill should have hit in-flight work"


# sync waits on the same dispatcher path as dora (`slow`, to keep the suite's time).
@pytest.mark.parametrize("mode", [pytest.param("sync", marks=pytest.mark.slow), "dora"])
def test_losing_every_server_fails_loudly(tmp_path, mode):
  """No live rollout server left: a clear error, not a hang or silent loss."""
  cfg = small_config(tmp_path, mode, total_steps=50, **{"rollout.num_servers": 1})

  def kill_all(rec, orch):
    if rec["step"] == 1:
      for c in orch.dispatcher.live_clients:
        c.driver.stop()

  t0 = time.time()
  with pytest.raises(NoLiveServersError, match="all rollout servers have failed"):
    run_training(cfg, after_step=kill_all)
  assert time.time() - t0 < 120
  events = read_log(pathlib.Path(cfg.output_dir) / "trained_samples.jsonl")
  issued = sum(e["event"] == "issued" for e in events)
  assert issued < 10 * 16, f"kept issuing work after the last server died ({issued} issues)"


def _train_cmd(out: pathlib.Path, steps: int) -> list[str]:
  return [
      sys.executable, "-m", "jax_dora.train", "--config=configs/tiny.py",
      "--config.precompile=False",
      "--config.mode=dora", f"--config.output_dir={out}", f"--config.total_steps={steps}",
      "--config.checkpoint.every_steps=2", "--config.progress_bar=False",
      "--config.eval.num_prompts=0", "--config.eval.at_start=False",
      "--config.learner.groups_per_step=4", "--config.learner.group_size=4",
  ]


def test_killed_run_resumes_without_losing_or_repeating_data(tmp_path):
  out = tmp_path / "run"
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  proc = subprocess.Popen(_train_cmd(out, 12), cwd=ROOT, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  metrics = out / "metrics.jsonl"
  deadline = time.time() + 240
  try:
    while time.time() < deadline:
      if metrics.exists() and len(metrics.read_text().splitlines()) >= 5:
        break
      assert proc.poll() is None, "training exited before it could be killed"
      time.sleep(0.2)
    else:
      pytest.fail("training did not reach step 5 in time")
    proc.send_signal(signal.SIGKILL)  # no chance to clean up
  finally:
    proc.wait(timeout=30)
  # Resume to completion.
  done = subprocess.run(_train_cmd(out, 8), cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  summary = json.loads((out / "summary.json").read_text())
  assert summary["steps"] == 8 and summary["integrity_violations"] == []
  records = read_log(out / "trained_samples.jsonl")
  trained = [r for r in records if r["event"] == "trained"]
  keys = [(r["sample_id"], r["member"]) for r in trained]
  assert len(keys) == len(set(keys)) == 8 * 16, "a sample was lost or trained twice"
  assert sorted({r["step"] for r in trained}) == list(range(1, 9))
  # Every prompt the stream ever handed out is trained, dropped or pending:
  # exactly the contiguous range of sample ids drawn, nothing lost in between
  # (a prompt drawn while a checkpoint was being written used to be neither).
  records = read_log(out / "trained_samples.jsonl")
  last_run = records[max(i for i, r in enumerate(records) if r["event"] == "run_start"):]
  accounted = ({r["sample_id"] for r in trained}
               | {r["sample_id"] for r in records if r["event"] == "rejected" and not r["regenerate"]}
               | {r["sample_id"] for r in last_run if r["event"] == "pending"})
  assert accounted == set(range(summary["samples_drawn"])), sorted(
      set(range(summary["samples_drawn"])) ^ accounted)
  # The resumed run's audit carries the first run's trained samples as history,
  # so training one of them again would be a violation.
  led = IntegrityLedger.from_log(out / "trained_samples.jsonl", group_size=4, max_staleness=2)
  assert led.check() == []
  # The metrics of the steps the killed run logged after its checkpoint were
  # replaced by the resumed run's: one record per step.
  assert _metric_steps(out) == list(range(1, 9))

  # A fresh run in the same directory starts it over: nothing of the old run
  # survives to be plotted, audited or resumed later.
  fresh = subprocess.run(_train_cmd(out, 3) + ["--config.checkpoint.resume=False"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
  assert fresh.returncode == 0, fresh.stderr[-3000:]
  assert _metric_steps(out) == [1, 2, 3]
  trained = [r for r in read_log(out / "trained_samples.jsonl") if r["event"] == "trained"]
  assert sorted({r["step"] for r in trained}) == [1, 2, 3]
  assert sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == [2, 3]


def _metric_steps(out: pathlib.Path) -> list[int]:
  return [json.loads(l)["step"] for l in (out / "metrics.jsonl").read_text().splitlines()]


def test_dora_with_fixed_answer_lengths_and_background_publishing(tmp_path):
  """``length_mode=answer``: every trajectory is exactly its answer long; the
  learner publishes in the background and the last version still lands."""
  from jax_dora.data import make_prompt_dataset  # pylint: disable=g-import-not-at-top
  from jax_dora.snapshots import SnapshotReader  # pylint: disable=g-import-not-at-top

  cfg = small_config(tmp_path, "dora", total_steps=6, **{
      "rollout.length_mode": "answer", "orchestrator.async_publish": True,
      "eval.num_prompts": 8})
  summary = run_training(cfg)
  assert summary["steps"] == 6 and summary["integrity_violations"] == []
  audit(cfg)
  out = pathlib.Path(cfg.output_dir)
  prompts = make_prompt_dataset(cfg)
  trained = [r for r in read_log(out / "trained_samples.jsonl") if r["event"] == "trained"]
  lengths = {r["sample_id"]: r["num_tokens"] for r in trained}
  assert all(r["num_tokens"] == len(prompts[r["sample_id"]].answer) for r in trained)
  assert len(set(lengths.values())) > 1  # the workload's lengths, not one cap
  # Background publishing: the learner ran ahead of Orbax at times, yet the
  # final version was published (and evaluated) before the run ended.
  recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
  assert all(r["published_version"] <= r["version"] for r in recs)
  assert SnapshotReader(out / "snapshots").latest_version() == 6


def _audit_dynamic_sampling(cfg) -> int:
  """Every drawn sample was trained once, dropped as ``zero_variance`` (with
  all-equal rewards in its group, read back from the log) or carried pending
  into the run checkpoint; returns the number of dropped groups."""
  records = read_log(pathlib.Path(cfg.output_dir) / "trained_samples.jsonl")
  issued = {(r["sample_id"], r["member"]) for r in records if r["event"] == "issued"}
  trained = [(r["sample_id"], r["member"]) for r in records if r["event"] == "trained"]
  rewards = {(r["sample_id"], r["member"]): r["reward"] for r in records if r["event"] == "finished"}
  dropped = set()
  for r in records:
    if r["event"] == "rejected" and r["reason"] == "zero_variance":
      assert not r["regenerate"]
      group = {(r["sample_id"], m) for m in r["members"]}
      assert len({rewards[k] for k in group}) == 1, (r, [rewards[k] for k in group])
      dropped |= group
  pending = {r["sample_id"] for r in records if r["event"] == "pending"}
  assert len(trained) == len(set(trained)) and not dropped & set(trained)
  rest = issued - set(trained) - dropped
  assert {sid for sid, _ in rest} <= pending, sorted(rest)
  return len(dropped) // cfg.learner.group_size


def test_sync_is_on_policy_with_unit_ratios_and_dynamic_sampling(tmp_path):
  """sync stays on-policy: every batch is generated by the version it trains at,
  also when dynamic sampling replaces zero-variance groups (on the same
  version). The learner's log-probs equal the rollout's: ratios 1, no
  mismatch KL, at the first step and every other."""
  cfg = small_config(tmp_path, "sync", total_steps=3, **{
      "orchestrator.async_publish": True, "learner.dynamic_sampling": True,
      # A random policy never writes a well-formed answer: every group scores
      # all 0, so each step drops its budget of groups, then trains the rest.
      "reward.functions": "format", "learner.dynamic_sampling_max_draws": 2})
  summary = run_training(cfg)
  ledger = audit(cfg)
  for r in ledger.trained_records():
    assert {s[2] for s in r["spans"]} == {r["learner_version"]}
  assert summary["rejected_groups"]["zero_variance"] == _audit_dynamic_sampling(cfg) > 0
  recs = read_metrics(pathlib.Path(cfg.output_dir) / "metrics.jsonl")
  for rec in recs:
    assert rec["train/mismatch/abs_log_ratio_mean"] < 1e-5, rec["step"]
    assert abs(rec["train/mismatch/kl_k3"]) < 1e-8, rec["step"]
    assert abs(rec["train/ratio_mean"] - 1.0) < 1e-5
    assert rec["train/stale_token_frac"] == 0.0


def test_dora_with_the_async_loss_options_keeps_the_constraints(tmp_path):
  """dora with decoupled PPO, token TIS, the log-linear proximal policy, Dr.GRPO
  advantages, dynamic sampling, overlong shaping and truncation masking: the
  integrity audit stays clean and the staleness metrics see old tokens."""
  cfg = small_config(tmp_path, "dora", total_steps=3, **{
      "learner.loss": "decoupled_ppo", "learner.is_correction": "tis",
      "learner.proximal_logprobs": "loglinear", "learner.advantage_estimator": "drgrpo",
      "learner.dynamic_sampling": True, "learner.mask_truncated": True,
      "reward.overlong_buffer": 8, "orchestrator.max_staleness": 2,
      "reward.functions": "format", "learner.dynamic_sampling_max_draws": 2})
  summary = run_training(cfg)
  assert summary["steps"] == 3 and summary["integrity_violations"] == []
  audit(cfg)
  # Requests aborted at shutdown carry the run's incarnation (they used to
  # carry none, were taken for another run's results and re-issued).
  records = read_log(pathlib.Path(cfg.output_dir) / "trained_samples.jsonl")
  assert [r for r in records if r["event"] == "reissued"] == []
  assert summary["rejected_groups"]["zero_variance"] == _audit_dynamic_sampling(cfg) > 0
  recs = read_metrics(pathlib.Path(cfg.output_dir) / "metrics.jsonl")
  assert max(r["train/stale_token_frac"] for r in recs) > 0
  # The format reward is 0 for a random policy: the reward is the overlong shaping.
  for r in recs:
    assert r["overlong_penalty_mean"] == pytest.approx(r["reward_mean"], abs=1e-6)
  for r in recs:
    assert r["train/is_weight_max"] <= cfg.learner.tis_cap + 1e-6
    assert 0 <= r["train/is_truncated_frac"] <= 1


def test_one_step_off_is_exactly_one_step_stale(tmp_path):
  """Every batch after the first is generated by the version before the one that
  trains it: staleness exactly 1, so ``max_staleness=1`` holds (it used to be 2
  and crash with "staleness bound violated")."""
  cfg = small_config(tmp_path, "one_step_off", **{"orchestrator.max_staleness": 1})
  summary = run_training(cfg)
  assert summary["steps"] == cfg.total_steps and summary["integrity_violations"] == []
  for r in audit(cfg).trained_records():
    staleness = {r["learner_version"] - s[2] for s in r["spans"]}
    assert staleness == ({0} if r["step"] == 1 else {1}), r


def test_a_non_finite_loss_stops_the_run_with_its_step(tmp_path):
  """An absurd learning rate blows the parameters up: the run stops loudly at the
  first non-finite step instead of training on (and logging null) for ever."""
  from jax_dora.learner.train_state import TrainingDivergedError  # pylint: disable=g-import-not-at-top

  cfg = small_config(tmp_path, "sync", total_steps=6, **{
      "learner.learning_rate": 1e30, "learner.warmup_steps": 0})
  with pytest.raises(TrainingDivergedError, match=r"learner step \d: non-finite .*loss=nan"):
    run_training(cfg)
  lines = (pathlib.Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()
  assert len(lines) < 6 and all(json.loads(l)["train/loss"] is not None for l in lines)


def test_eval_completions_are_never_truncated_by_a_publish(tmp_path):
  """async_unfiltered aborts in-flight rollouts on every publish; held-out eval
  requests used to be aborted too and their truncated completions scored."""
  cfg = small_config(tmp_path, "async_unfiltered", total_steps=3, **{
      "rollout.length_mode": "answer", "eval.num_prompts": 16, "eval.every_steps": 1})
  seen: list[list[tuple[int, str, int]]] = []

  def record(rec, orch):
    seen.append(list(orch.last_eval_completions))
    answers = {p.sample_id: p for p in orch.eval_prompts}
    for sid, reason, n in orch.last_eval_completions:
      want, _ = orch.length_budget(answers[sid])
      assert (reason, n) == ("length", want), (sid, reason, n, want)

  summary = run_training(cfg, after_step=record)
  assert summary["steps"] == 3 and len(seen) == 3 and all(len(s) == 16 for s in seen)
