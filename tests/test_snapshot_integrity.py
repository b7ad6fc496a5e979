"""Snapshot integrity (issue 28, item 3): checksums recorded at publish, verified at load and
against the learner's own parameters.

Oracle for the checksum: the two 32-bit sums computed here by hand in numpy. Faults are
injected at run time: parameters perturbed between the checksum and the write (a server
must refuse the version, naming it and the leaf), and a publisher handed other parameters
than the learner's (the learner's own check must report it as an integrity violation).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_dora.snapshots import (
    SnapshotIntegrityError,
    SnapshotPublisher,
    SnapshotReader,
    abstract_target_like,
    checksum,
)
from jax_dora.snapshots import store


def _by_hand(x: np.ndarray) -> tuple[int, int]:
  bits = x.reshape(-1).view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize]).astype(
      np.uint64)
  weight = 2 * np.arange(bits.size, dtype=np.uint64) + 1
  return int(bits.sum() % 2**32), int((bits * weight % 2**32).sum() % 2**32)


def _tree():
  rng = np.random.default_rng(0)
  return {"a": {"kernel": rng.normal(size=(8, 6)).astype(np.float32)},
          "b": rng.normal(size=(16,)).astype(np.float32)}


def test_checksums_equal_a_hand_computation_whatever_the_sharding():
  tree = _tree()
  host = checksum.checksums(tree)
  assert host["a/kernel"] == ("float32", *_by_hand(tree["a"]["kernel"]))
  assert host["b"] == ("float32", *_by_hand(tree["b"]))
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("x", "y"))
  sharded = {"a": {"kernel": jax.device_put(tree["a"]["kernel"], NamedSharding(mesh, P("x", "y")))},
             "b": jax.device_put(tree["b"], NamedSharding(mesh, P("y")))}
  assert checksum.checksums(sharded) == host
  cast = checksum.checksums(tree, cast="bfloat16")
  assert cast["b"] == ("bfloat16", *_by_hand(tree["b"].astype(ml_dtypes.bfloat16)))
  # One flipped bit, or two swapped elements, change the sums.
  flipped = {"a": tree["a"], "b": tree["b"].copy()}
  flipped["b"].view(np.uint32)[3] ^= 1
  assert checksum.checksums(flipped)["b"] != host["b"]
  swapped = {"a": tree["a"], "b": tree["b"][[1, 0] + list(range(2, 16))]}
  assert checksum.checksums(swapped)["b"][2] != host["b"][2]  # the weighted sum


@pytest.mark.parametrize("restore_dtype", ["float32", "bfloat16"])
def test_a_snapshot_changed_after_its_checksum_is_refused(tmp_path, monkeypatch, restore_dtype):
  """What a server restores (as published, or cast to bfloat16 as rollout.param_dtype
  does) is checked against the publisher's record; a perturbation between the checksum
  and the write stops the load naming the version and the leaf."""
  tree = _tree()
  publisher = SnapshotPublisher(tmp_path, max_to_keep=None, checksum_casts=("bfloat16",))
  publisher.publish(0, tree)
  real = store.savable
  monkeypatch.setattr(store, "savable", lambda t: real(
      jax.tree.map(lambda x: x, t) | {"b": np.asarray(t["b"]) + np.float32(1e-3)}))
  publisher.publish(1, tree)
  publisher.close()
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = abstract_target_like(jax.tree.map(lambda x: x.astype(restore_dtype), tree), device)
  reader = SnapshotReader(tmp_path)
  params, meta = reader.load(0, target=target)
  assert set(meta["checksums"]) == {"published", "bfloat16"}
  assert params["b"].dtype == jnp.dtype(restore_dtype)
  with pytest.raises(SnapshotIntegrityError, match=r"version 1 .*leaf b \("):
    reader.load(1, target=target)
  assert reader.integrity_failures == 1
  SnapshotReader(tmp_path, verify_checksums=False).load(1, target=target)  # the opt-out


def _tiny_run(out, mode: str, verify_fraction: float | None = None, steps: int = 3,
              **overrides) -> dict:
  """A ``steps``-step run of the tiny model that checks every published version;
  ``overrides``: ``block__name=value``."""
  from jax_dora.config import base_config  # pylint: disable=g-import-not-at-top
  from jax_dora.runtime import run_training  # pylint: disable=g-import-not-at-top

  cfg = base_config()
  cfg.mode = mode
  cfg.output_dir = str(out)
  cfg.total_steps = steps
  cfg.progress_bar = False
  cfg.eval.num_prompts = 0
  cfg.eval.at_start = False
  cfg.snapshots.verify_every = 1
  if verify_fraction is not None:
    cfg.audit.verify_fraction = verify_fraction
    cfg.audit.label_time_share = 1.0
  for key, value in overrides.items():
    block, name = key.split("__")
    cfg[block][name] = value
  return run_training(cfg)


@pytest.mark.parametrize("transport", ["orbax", "device"])
def test_a_run_publishing_other_params_than_the_learners_fails_its_audit(tmp_path, monkeypatch,
                                                                         transport):
  """The publisher is handed perturbed parameters (its checksums describe them, so servers
  load them happily); the learner's own check of every version reports each one, whether
  versions travel as files or in memory."""
  from jax_dora.snapshots.memory import TransportPublisher  # pylint: disable=g-import-not-at-top

  cls = SnapshotPublisher if transport == "orbax" else TransportPublisher
  real = cls.publish

  def perturbed(self, version, params, metadata=None, **kwargs):
    if version >= 2:
      params = jax.tree.map(lambda x: x * 1.001, params)
    return real(self, version, params, metadata, **kwargs)

  monkeypatch.setattr(cls, "publish", perturbed)
  summary = _tiny_run(tmp_path / "run", "sync", snapshots__transport=transport)
  bad = [v for v in summary["integrity_violations"] if v.startswith("snapshot version")]
  assert [v.split(":")[0] for v in bad] == ["snapshot version 2", "snapshot version 3"], \
      summary["integrity_violations"]
  assert "the publisher recorded" in bad[0]
  assert len(summary["integrity_violations"]) == 2
  assert summary["audit"]["violations"] == {"bookkeeping": 0, "snapshots": 2, "version_labels": 0,
                                            "rewards": 0, "tool_calls": 0}


def test_a_stored_reward_that_is_not_the_reward_functions_is_a_violation(tmp_path, monkeypatch):
  """Rewards off by a constant for some trajectories (injected where the run records a
  finished trajectory) are found by re-scoring every trained one; a clean run reports none."""
  from jax_dora.orchestrator.integrity import IntegrityLedger  # pylint: disable=g-import-not-at-top

  clean = _tiny_run(tmp_path / "clean", "dora_pace", verify_fraction=1.0)
  assert clean["integrity_violations"] == []
  assert clean["audit"]["rewards_rescored"] == 3 * 8 * 8 and clean["audit"]["snapshots_checked"] >= 2

  real = IntegrityLedger.finished

  def wrong_reward(self, traj):
    if traj.sample_id % 3 == 0:
      traj.reward += 0.25
    return real(self, traj)

  monkeypatch.setattr(IntegrityLedger, "finished", wrong_reward)
  summary = _tiny_run(tmp_path / "faulty", "dora_pace", verify_fraction=1.0)
  bad = summary["integrity_violations"]
  assert bad and all("the reward functions give" in v for v in bad), bad
  assert {int(v.split(",")[0].strip("(")) % 3 for v in bad} == {0}
  assert summary["audit"]["violations"]["rewards"] == len(bad)

  # The same verdicts from the run directories alone (the faulty run's snapshots are clean);
  # and a snapshot file of the clean run corrupted on disk after the run is found offline,
  # with nothing else reported.
  assert _offline(tmp_path / "faulty")["violations"] == {
      "bookkeeping": 0, "snapshots": 0, "version_labels": 0, "rewards": len(bad)}
  chunk = next(f for f in sorted((tmp_path / "clean" / "snapshots" / "2").rglob("*"))
               if f.is_file() and "params" in str(f) and f.stat().st_size > 64)
  chunk.write_bytes(chunk.read_bytes()[:-8] + bytes(8))
  clean_offline = _offline(tmp_path / "clean")["violations"]
  assert clean_offline["snapshots"] >= 1
  assert {k: v for k, v in clean_offline.items() if k != "snapshots"} == {
      "bookkeeping": 0, "version_labels": 0, "rewards": 0}


def _offline(run_dir) -> dict:
  """``python -m jax_dora.audit RUN_DIR --json``'s report."""
  import json  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top

  proc = subprocess.run([sys.executable, "-m", "jax_dora.audit", str(run_dir), "--json"],
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode in (0, 3), proc.stderr[-3000:]
  report = json.loads(proc.stdout)
  assert (proc.returncode == 3) == any(report["violations"].values())
  return report


def test_a_wrong_version_label_is_found_online_and_offline(tmp_path, monkeypatch):
  """Spans relabelled one version older where the run records a finished trajectory (a
  server that loaded one version and reported another): every relabelled trajectory that
  trained is a version-label violation naming it, during the run and again from the run
  directory alone (``python -m jax_dora.audit``); nothing else is. The staleness bound is
  wide enough that the older label breaks no bookkeeping rule: only recomputing the
  log-probs can tell.

  Only trajectories of at least 8 sampled tokens are relabelled: the statistic is a mean
  over the span, and a span of one or two near-certain tokens can agree between adjacent
  versions to within the float32 tolerance (1e-3), a wrong label the check cannot see (the
  README's label-audit section says so). Over 8+ tokens the smallest off-by-one statistic
  seen in repeated runs of this test was 5e-3."""
  from jax_dora.audit import labels  # pylint: disable=g-import-not-at-top
  from jax_dora.orchestrator.integrity import IntegrityLedger  # pylint: disable=g-import-not-at-top
  from jax_dora.types import TokenSpan  # pylint: disable=g-import-not-at-top

  real = IntegrityLedger.finished
  relabelled = set()

  def older_label(self, traj):
    if (traj.sample_id % 2 == 0 and min(s.version for s in traj.spans) >= 1
        and traj.num_sampled_tokens >= 8):
      traj.spans = [TokenSpan(s.start, s.end, s.version - 1) for s in traj.spans]
      relabelled.add(traj.key)
    return real(self, traj)

  # Observed, not replaced: every check's statistic, to say which label passed on a failure.
  real_recompute, checks = labels.recompute, []

  def observed(*args, **kwargs):
    out = real_recompute(*args, **kwargs)
    checks.extend(out)
    return out

  monkeypatch.setattr(IntegrityLedger, "finished", older_label)
  monkeypatch.setattr(labels, "recompute", observed)
  out = tmp_path / "run"
  summary = _tiny_run(out, "dora", verify_fraction=1.0, steps=5,
                      orchestrator__max_staleness=8, snapshots__max_to_keep=0)
  trained = {(r["sample_id"], r["member"]) for r in IntegrityLedger.from_log(
      out / "trained_samples.jsonl", group_size=8, max_staleness=8).trained_records()}
  wrong = relabelled & trained
  assert wrong, "no relabelled trajectory was trained: the run is too short to test anything"
  audit = summary["audit"]
  named = {tuple(int(x) for x in v[1:v.index(")")].split(","))
           for v in summary["integrity_violations"] if v.startswith("(")}
  passed = [(c.key, c.version, c.tokens, c.mean_abs) for c in checks if c.key in wrong - named]
  assert named == wrong, f"wrong labels not flagged: {passed}; audit {audit}"
  assert audit["violations"] == {"bookkeeping": 0, "snapshots": 0, "version_labels": len(wrong),
                                 "rewards": 0, "tool_calls": 0}, summary["integrity_violations"]
  assert audit["labels_unverifiable"] == 0
  assert all("labelled version" in v for v in summary["integrity_violations"])

  report = _offline(out)
  assert report["violations"] == {"bookkeeping": 0, "snapshots": 0,
                                  "version_labels": len(wrong), "rewards": 0}
  assert report["checked"]["labels_checked"] == audit["labels_checked"] > len(wrong)
  assert report["recorded_during_run"]["version_labels"] == len(wrong)


def test_the_label_check_stays_within_its_share_of_the_wall_clock(tmp_path):
  """With no time allowed (label_time_share 0) the first check runs, every later step skips
  its version (counted, not passed), and the end of the run drains what is left: every
  labelled (trajectory, version) pair is accounted for once."""
  from jax_dora.orchestrator.integrity import IntegrityLedger  # pylint: disable=g-import-not-at-top

  out = tmp_path / "run"
  summary = _tiny_run(out, "one_step_off", verify_fraction=1.0, steps=4,
                      audit__label_time_share=0.0)
  audit = summary["audit"]
  trained = IntegrityLedger.from_log(out / "trained_samples.jsonl", group_size=8,
                                     max_staleness=2).trained_records()
  pairs = sum(len({s[2] for s in r["spans"]}) for r in trained)
  assert audit["labels_skipped"] > 0 and audit["labels_checked"] > 0
  assert audit["labels_checked"] + audit["labels_skipped"] + audit["labels_unverifiable"] == pairs
  assert summary["integrity_violations"] == []


def test_host_and_jitted_checksums_agree_on_every_layout():
  """The two implementations of the one definition (numpy on host shards, the jitted
  program elsewhere) against each other and the flat hand computation: shards that start
  mid-array on every axis, replicated and partially replicated layouts, rank 0 to 3,
  1/2/4-byte dtypes, NaN payloads and -0.0."""
  rng = np.random.default_rng(1)
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("x", "y"))
  odd = rng.normal(size=(4, 6, 10)).astype(np.float32)
  odd.reshape(-1)[[0, 7]] = [np.nan, -0.0]
  odd.view(np.uint32).reshape(-1)[9] = 0x7FC01234  # a NaN with a payload
  cases = [
      (odd, P("x", None, "y")), (odd, P(None, "y", "x")), (odd, P()),
      (rng.normal(size=(12, 8)).astype(ml_dtypes.bfloat16), P("y", "x")),
      (rng.normal(size=(12, 8)).astype(ml_dtypes.bfloat16), P(None, "x")),  # y replicates
      (rng.integers(0, 255, size=(16,), dtype=np.uint8), P(("x", "y"))),
      (np.float32(3.5).reshape(()), P()),
  ]
  for value, spec in cases:
    placed = jax.device_put(value, NamedSharding(mesh, spec))
    by_hand = _by_hand(np.asarray(value))
    host = checksum.checksums({"v": placed})["v"][1:]
    jitted = tuple(int(v) for v in np.asarray(checksum._tree_sums([placed]))[0])
    assert host == jitted == by_hand, (value.dtype, value.shape, spec)
    assert checksum._host_summable(placed, None)  # the host path really ran
