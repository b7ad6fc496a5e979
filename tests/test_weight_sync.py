"""Weight sync transports: every path delivers the learner's exact parameters, or nothing.

The learner's parameters live sharded on a (fsdp=2, tensor=2) learner mesh
(devices 0-3); the server is a real ``DoraEngine`` on devices 4-5 with 2-way
tensor parallelism. The oracle for "bit-identical" is the learner's own
arrays, fetched to the host and compared byte for byte (or, for a bfloat16
server, cast with ``ml_dtypes`` on the host), not the checksum code the
transports use themselves. Durable versions are real Orbax directories.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_dora.audit.snapshots import SnapshotAudit
from jax_dora.config import ConfigError, base_config, validate
from jax_dora.learner.mesh import LOGICAL_AXIS_RULES, make_mesh
from jax_dora.model import CharTokenizer, ModelConfig, init_params, param_logical_specs
from jax_dora.model.param_copy import cast_copy
from jax_dora.rollout.driver import RolloutDriver
from jax_dora.rollout.engine import DoraEngine
from jax_dora.snapshots import (SnapshotIntegrityError, SnapshotNotFoundError, SnapshotPublisher,
                                SnapshotReader)
from jax_dora.snapshots import memory as memory_lib
from jax_dora.snapshots.memory import MemorySnapshots, TieredReader, TransportPublisher
from jax_dora.snapshots.transfer import TransferOffers, TransferSource

TOK = CharTokenizer()
CFG = ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                  d_ff=64, max_seq_len=48)


def _learner_params(seed: int):
  """Random params on the learner's mesh with the learner's sharding rules."""
  mesh = make_mesh(jax.devices()[:4], data=1, fsdp=2, tensor=2)
  with nn.logical_axis_rules(LOGICAL_AXIS_RULES):
    shardings = nn.logical_to_mesh_sharding(param_logical_specs(CFG), mesh, LOGICAL_AXIS_RULES)
  return jax.device_put(init_params(CFG, jax.random.PRNGKey(seed)), shardings)


def _engine(param_dtype: str = "float32") -> DoraEngine:
  cfg = dataclasses.replace(CFG, param_dtype=param_dtype)
  return DoraEngine(cfg, TOK, num_slots=2, max_prefill_length=16, temperature=1.0,
                    devices=jax.devices()[4:6], tensor_parallel=2)


def _host(tree, dtype=None):
  leaves = jax.tree.leaves(jax.device_get(tree))
  return [np.asarray(x).astype(dtype) if dtype is not None else np.asarray(x) for x in leaves]


def _assert_bytes_equal(got, want):
  assert len(got) == len(want)
  for a, b in zip(got, want):
    assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_device_transport_delivers_the_learners_bytes_with_two_live_versions(tmp_path, dtype):
  """Versions 1-4 published through memory (Orbax every 2nd, plus the first); a TP-2 server
  holds two of them at once, each byte-equal to the learner's tree (cast on the host for a
  bfloat16 server); the durable ones are on disk and restore to the same bytes."""
  write = None if dtype == "float32" else dtype
  disk = SnapshotPublisher(tmp_path / "snaps", max_to_keep=None, incarnation="inc",
                           write_dtype=write)
  pub = TransportPublisher(disk, MemorySnapshots(keep=3), durable_every=2)
  reader = TieredReader(pub.memory, SnapshotReader(tmp_path / "snaps"))
  learner = {v: _learner_params(v) for v in (1, 2, 3, 4)}
  want = {v: _host(learner[v], ml_dtypes.bfloat16 if write else None) for v in learner}
  for v in (1, 2, 3, 4):
    pub.publish(v, learner[v], {"step": v})
  engine = _engine(dtype)
  held = {v: engine.load_params(reader, v, "inc") for v in (3, 4)}  # two live versions
  for v, params in held.items():
    assert {d.id for x in jax.tree.leaves(params) for d in x.devices()} == {4, 5}
    _assert_bytes_equal(_host(params), want[v])
  pub.wait_until_finished()
  assert SnapshotReader(tmp_path / "snaps").versions() == [1, 2, 4]
  assert pub.memory.versions() == [2, 3, 4]
  on_disk = engine.load_params(SnapshotReader(tmp_path / "snaps"), 2, "inc")
  _assert_bytes_equal(_host(on_disk), want[2])
  # The learner's own check of a published version (its checksums in the written dtype).
  audit = SnapshotAudit(reader, every=1, cast=write)
  audit.remember(4, learner[4])
  assert audit.check(4) is None
  audit.remember(3, learner[4])  # the wrong parameters for version 3
  assert audit.check(3) is not None
  pub.close()


def test_a_detached_copy_is_served_as_it_is(tmp_path):
  """The asynchronous modes' path: the learner's detached copy in the publisher's write dtype
  (``cast_copy``, what ``TrainState.detached_params(version, dtype)`` makes: bfloat16, on the
  learner's devices, new buffers), ``publish(owned=True)`` serves exactly those buffers (no
  second copy), and a server loads the learner's bytes from them, verified."""
  disk = SnapshotPublisher(tmp_path / "snaps", max_to_keep=None, write_dtype="bfloat16")
  pub = TransportPublisher(disk, MemorySnapshots(keep=2), durable_every=0)
  learner = _learner_params(7)
  assert pub.write_dtype == "bfloat16"
  served = cast_copy(learner, pub.write_dtype)
  assert all(x.dtype == jnp.bfloat16 and x.sharding.is_equivalent_to(y.sharding, x.ndim)
             for x, y in zip(jax.tree.leaves(served), jax.tree.leaves(learner)))
  assert all(a.data.unsafe_buffer_pointer() != b.data.unsafe_buffer_pointer()
             for x, y in zip(jax.tree.leaves(served), jax.tree.leaves(learner))
             for a, b in zip(x.addressable_shards, y.addressable_shards))
  pub.publish(1, served, {"step": 1}, owned=True)
  held, _ = pub.memory.get(1)
  assert all(a is b for a, b in zip(jax.tree.leaves(held), jax.tree.leaves(served)))
  reader = TieredReader(pub.memory, SnapshotReader(tmp_path / "snaps"))
  _assert_bytes_equal(_host(_engine("bfloat16").load_params(reader, 1)),
                      _host(learner, ml_dtypes.bfloat16))
  pub.close()


def test_orbax_transport_writes_the_servers_dtype(tmp_path):
  """``write_dtype=bfloat16``: the file holds bfloat16 (half the bytes), a bfloat16 server
  restores the learner's values cast on the host, verified against the record."""
  learner = _learner_params(7)
  with SnapshotPublisher(tmp_path / "snaps", write_dtype="bfloat16") as pub:
    pub.publish(1, learner, {"step": 1})
  reader = SnapshotReader(tmp_path / "snaps")
  raw, meta = reader.load(1)
  assert {x.dtype for x in jax.tree.leaves(raw)} == {np.dtype(ml_dtypes.bfloat16)}
  assert {rec[0] for rec in meta["checksums"]["published"].values()} == {"bfloat16"}
  params = _engine("bfloat16").load_params(reader, 1)
  _assert_bytes_equal(_host(params), _host(learner, ml_dtypes.bfloat16))


def test_killed_or_corrupt_transfer_leaves_the_server_on_its_versions(tmp_path, monkeypatch):
  """A transfer that dies midway (the device copy raises) and a version whose in-memory
  copy was damaged after publishing: both loads fail, the server keeps serving version 1,
  counts the refusal, and loads version 2 once it arrives intact."""
  disk = SnapshotPublisher(tmp_path / "snaps", max_to_keep=None, incarnation="inc")
  pub = TransportPublisher(disk, MemorySnapshots(keep=4), durable_every=0)
  reader = TieredReader(pub.memory, SnapshotReader(tmp_path / "snaps"))
  driver = RolloutDriver(_engine(), reader, max_versions=2, name="sync")
  try:
    pub.publish(1, _learner_params(1), {"step": 1})
    driver.load_version(1, "inc")
    pub.publish(2, _learner_params(2), {"step": 2})
    real_put = jax.device_put

    def dies_midway(x, *args, **kwargs):
      raise RuntimeError("transfer killed")

    monkeypatch.setattr(memory_lib.jax, "device_put", dies_midway)
    with pytest.raises(RuntimeError, match="transfer killed"):
      driver.load_version(2, "inc")
    monkeypatch.setattr(memory_lib.jax, "device_put", real_put)
    assert driver.status().versions_loaded == (1,)
    # Damage the held copy of version 3 after its checksums were recorded.
    pub.publish(3, _learner_params(3), {"step": 3})
    params, meta = pub.memory.get(3)
    leaf = jax.tree.leaves(params)[0]
    broken = jax.tree.unflatten(jax.tree.structure(params),
                                [leaf.at[0].add(1.0)] + jax.tree.leaves(params)[1:])
    pub.memory.put(3, broken, meta)
    with pytest.raises(SnapshotIntegrityError):
      driver.load_version(3, "inc")
    assert driver.status().versions_loaded == (1,)
    assert driver.versions.integrity_failures == 1
    driver.load_version(2, "inc")  # intact: served, and version 1 (unused) retires
    assert driver.status().versions_loaded == (2,)
  finally:
    driver.stop()
    pub.close()


def test_restarted_server_catches_up_from_memory_and_durable_versions(tmp_path):
  """Memory keeps the newest 2; Orbax every 2nd: a fresh server (restart) gets the newest
  version from memory, an older durable one from disk, and a version in neither is a clear
  not-found, never a wrong load."""
  disk = SnapshotPublisher(tmp_path / "snaps", max_to_keep=None, incarnation="inc")
  pub = TransportPublisher(disk, MemorySnapshots(keep=2), durable_every=2)
  learner = {v: _learner_params(v) for v in range(1, 6)}
  for v in range(1, 6):
    pub.publish(v, learner[v], {"step": v})
  pub.wait_until_finished()
  reader = TieredReader(pub.memory, SnapshotReader(tmp_path / "snaps"))
  assert reader.versions() == [1, 2, 4, 5] and pub.memory.versions() == [4, 5]
  engine = _engine()
  _assert_bytes_equal(_host(engine.load_params(reader, 5, "inc")), _host(learner[5]))
  _assert_bytes_equal(_host(engine.load_params(reader, 2, "inc")), _host(learner[2]))
  with pytest.raises(SnapshotNotFoundError):
    engine.load_params(reader, 3, "inc")
  with pytest.raises(SnapshotNotFoundError, match="incarnation"):
    engine.load_params(reader, 5, "another-run")
  pub.close()


def test_transfer_server_offer_pulled_onto_a_tp2_server_is_the_learners_bytes(tmp_path):
  """JAX's transfer server (``jax.experimental.transfer``, on CPU): the learner stages a
  version in the server's tensor-parallel layout and offers it; the server pulls it onto its
  devices, byte-equal to the learner's. An offer staged for another layout, and one whose
  recorded checksums do not match, are refused with clear errors."""
  disk = SnapshotPublisher(tmp_path / "snaps", max_to_keep=None, incarnation="inc")
  pub = TransportPublisher(disk, MemorySnapshots(keep=2), durable_every=0)
  offers = TransferOffers(pub.memory, CFG, jax.devices()[:4], "127.0.0.1")
  learner = _learner_params(3)
  pub.publish(1, learner, {"step": 1})
  engine = _engine()
  params = engine.load_params(TransferSource(offers.offer(1, tensor_parallel=2), 1), 1, "inc")
  assert {d.id for x in jax.tree.leaves(params) for d in x.devices()} == {4, 5}
  _assert_bytes_equal(_host(params), _host(learner))
  # The learner's fsdp x tensor layout is not the offer's: every leaf was staged.
  assert (offers.staged, offers.offered_as_is) == (len(jax.tree.leaves(learner)), 0)
  with pytest.raises(ValueError, match="tensor_parallel"):
    engine.load_params(TransferSource(offers.offer(1, tensor_parallel=1), 1), 1, "inc")
  bad = offers.offer(1, tensor_parallel=2)
  first = sorted(bad["metadata"]["checksums"]["published"])[0]
  bad["metadata"]["checksums"]["published"][first][1] += 1
  with pytest.raises(SnapshotIntegrityError, match=first):
    engine.load_params(TransferSource(bad, 1), 1, "inc")
  with pytest.raises(SnapshotNotFoundError, match="incarnation"):
    engine.load_params(TransferSource(offers.offer(1, tensor_parallel=2), 1), 1, "other")
  pub.close()


def test_versions_staged_at_publish_are_offered_to_every_server_as_they_are(tmp_path):
  """The runtime's transfer_server publisher: each version is staged once, at publish, in the
  servers' tensor-parallel layout and kept that way;
  offers to two servers stage nothing more, both pull the learner's bytes, and the audits'
  reader still restores the kept version onto the learner's own layout, verified."""
  disk = SnapshotPublisher(tmp_path / "snaps", max_to_keep=None, incarnation="inc",
                           write_dtype="bfloat16")
  memory = MemorySnapshots(keep=2)
  offers = TransferOffers(memory, CFG, jax.devices()[:4], "127.0.0.1")
  pub = TransportPublisher(disk, memory, durable_every=0,
                           serve_layout=lambda tree: offers.stage(tree, 2))
  learner = _learner_params(5)
  leaves = len(jax.tree.leaves(learner))
  detached = cast_copy(learner, "bfloat16")
  pub.publish(1, detached, {"step": 1}, owned=True)
  kept, _ = memory.get(1)
  layout = jax.tree.leaves(offers._layout(2))  # pylint: disable=protected-access
  assert all(x.sharding == s for x, s in zip(jax.tree.leaves(kept), layout))
  assert (offers.staged, offers.offered_as_is) == (leaves, 0)
  want = _host(learner, ml_dtypes.bfloat16)
  for _ in range(2):  # two servers
    got = _engine("bfloat16").load_params(TransferSource(offers.offer(1, tensor_parallel=2), 1),
                                          1, "inc")
    _assert_bytes_equal(_host(got), want)
  assert (offers.staged, offers.offered_as_is) == (leaves, 2 * leaves)
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16, sharding=x.sharding),
                        learner)
  back, _ = TieredReader(memory, SnapshotReader(tmp_path / "snaps")).load(1, target=target)
  assert all(x.sharding == t.sharding for x, t in zip(jax.tree.leaves(back),
                                                       jax.tree.leaves(target)))
  _assert_bytes_equal(_host(back), want)
  pub.close()


def test_a_one_device_learner_offers_its_served_copy_without_staging(tmp_path):
  """A one-device learner and a server without tensor parallelism: the served copy already
  has the offer's layout, so it is offered as it is (no second copy on the learner), and the
  server still pulls the learner's exact bytes onto its own device."""
  disk = SnapshotPublisher(tmp_path / "snaps", max_to_keep=None, incarnation="inc")
  pub = TransportPublisher(disk, MemorySnapshots(keep=2), durable_every=0)
  offers = TransferOffers(pub.memory, CFG, jax.devices()[:1], "127.0.0.1")
  mesh = make_mesh(jax.devices()[:1], data=1, fsdp=1, tensor=1)
  with nn.logical_axis_rules(LOGICAL_AXIS_RULES):
    shardings = nn.logical_to_mesh_sharding(param_logical_specs(CFG), mesh, LOGICAL_AXIS_RULES)
  learner = jax.device_put(init_params(CFG, jax.random.PRNGKey(4)), shardings)
  pub.publish(1, learner, {"step": 1})
  engine = DoraEngine(CFG, TOK, num_slots=2, max_prefill_length=16, temperature=1.0,
                      devices=jax.devices()[5:6])
  params = engine.load_params(TransferSource(offers.offer(1, tensor_parallel=1), 1), 1, "inc")
  assert (offers.staged, offers.offered_as_is) == (0, len(jax.tree.leaves(learner)))
  assert {d.id for x in jax.tree.leaves(params) for d in x.devices()} == {5}
  _assert_bytes_equal(_host(params), _host(learner))
  pub.close()


def test_remote_server_trains_on_versions_pulled_through_the_transfer_server(tmp_path):
  """The pod layout on loopback: a ``server_main`` process and a learner with
  ``snapshots.transport=transfer_server`` and no durable versions but the first: every later
  version reaches the server only by a pull; the run's audit is clean and the on-policy
  ratio of sync is exactly 1 (the server decoded with the learner's exact parameters)."""
  import json  # pylint: disable=g-import-not-at-top

  from _harness import RolloutServerProcess  # pylint: disable=g-import-not-at-top

  from jax_dora.runtime import run_training  # pylint: disable=g-import-not-at-top

  snaps = tmp_path / "snaps"
  server = RolloutServerProcess(snaps, tmp_path / "server.log", slots=8)
  try:
    cfg = base_config()
    cfg.mode = "sync"
    cfg.output_dir = str(tmp_path / "run")
    cfg.total_steps = 3
    cfg.progress_bar = False
    cfg.eval.num_prompts = 0
    cfg.eval.at_start = False
    cfg.role = "learner"
    cfg.rollout.server_addresses = server.address
    cfg.snapshots.directory = str(snaps)
    cfg.snapshots.transport = "transfer_server"
    cfg.snapshots.durable_every = 0
    cfg.snapshots.verify_every = 1
    summary = run_training(cfg)
  finally:
    server.close()
  assert summary["steps"] == 3 and summary["integrity_violations"] == [], summary
  assert SnapshotReader(snaps).versions() == [0]  # versions 1-3 travelled only by transfer
  recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert all(abs(r["train/ratio_mean"] - 1.0) < 1e-4 for r in recs)
  assert "Traceback" not in server.log()


def test_transport_config_resolves_and_rejects_device_for_remote_servers():
  cfg = base_config()
  assert validate(cfg).snapshot_transport == "device"  # embedded servers, one process
  cfg.rollout.server_addresses = "localhost:9000"
  cfg.role = "learner"
  assert validate(cfg).snapshot_transport == "orbax"
  cfg.snapshots.transport = "transfer_server"
  assert validate(cfg).snapshot_transport == "transfer_server"
  cfg.snapshots.transport = "device"
  with pytest.raises(ConfigError, match="snapshots.transport=orbax"):
    validate(cfg)
  cfg = base_config()
  cfg.snapshots.transport = "transfer_server"  # embedded servers: no remote server to pull
  with pytest.raises(ConfigError, match="transfer_server"):
    validate(cfg)
  cfg = base_config()
  cfg.rollout.param_dtype = "bfloat16"
  assert validate(cfg).snapshot_write_dtype == "bfloat16"
  cfg.snapshots.write_dtype = "master"
  assert validate(cfg).snapshot_write_dtype is None
