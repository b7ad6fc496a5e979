"""Tests for jax_dora.snapshots: the learner -> rollout parameter channel."""

from __future__ import annotations

import os

# Restoring onto "rollout devices" needs several devices; force host devices
# before jax initialises (no-op if the runner already set it).
os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import pathlib
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dora import snapshots
from jax_dora.snapshots import SnapshotCorruptError
from jax_dora.snapshots import SnapshotNotFoundError
from jax_dora.snapshots import SnapshotPublisher
from jax_dora.snapshots import SnapshotReader

_REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _params(value: float = 1.0):
  return {
      'embed': jnp.full((4, 8), value, jnp.float32),
      'layers': {
          'w': jnp.full((8, 8), value, jnp.bfloat16),
          'b': jnp.arange(8, dtype=jnp.float32) + value,
      },
      'step': jnp.asarray(int(value), jnp.int32),
  }


def _assert_tree_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_params_and_metadata(tmp_path):
  params = _params(3.0)
  with SnapshotPublisher(tmp_path / 'snaps') as pub:
    pub.publish(7, params, {'version': 7, 'learner_step': 70})
  reader = SnapshotReader(tmp_path / 'snaps')
  loaded, meta = reader.load(7)
  _assert_tree_equal(loaded, params)
  assert set(meta.pop('checksums')) == {'published'}  # what readers verify against
  assert meta == {'version': 7, 'learner_step': 70}
  assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(loaded))
  # Default load is the latest; missing metadata is stored as {} (plus the checksums).
  with SnapshotPublisher(tmp_path / 'snaps') as pub:
    assert pub.last_version == 7  # Picks up what is already on disk.
    pub.publish(8, params)
  assert set(reader.load()[1]) == {'checksums'}


def test_versions_and_retention(tmp_path):
  reader = SnapshotReader(tmp_path / 'snaps')
  assert reader.versions() == []  # Directory not created yet.
  assert reader.latest_version() is None
  with SnapshotPublisher(tmp_path / 'snaps', max_to_keep=2) as pub:
    for v in (1, 2, 5):
      pub.publish(v, _params(v), {'version': v})
      assert reader.latest_version() == v
  assert reader.versions() == [2, 5]
  # Retired versions are gone from disk too, not just from the listing.
  leftovers = [p.name for p in (tmp_path / 'snaps').iterdir()]
  assert '1' not in leftovers
  assert not any((tmp_path / 'snaps' / '.snapshot-trash').glob('*'))


def test_unfinalized_snapshot_is_invisible(tmp_path):
  with SnapshotPublisher(tmp_path) as pub:
    pub.publish(1, _params(1.0))
  # What a publisher that crashed mid-write leaves behind.
  tmp_dir = tmp_path / '2.orbax-checkpoint-tmp-1234567890'
  (tmp_dir / 'params').mkdir(parents=True)
  reader = SnapshotReader(tmp_path)
  assert reader.versions() == [1]
  with pytest.raises(SnapshotNotFoundError):
    reader.load(2)
  # A restarted publisher cleans it up and may reuse the version.
  with SnapshotPublisher(tmp_path) as pub:
    assert not tmp_dir.exists()
    pub.publish(2, _params(2.0))
  _assert_tree_equal(reader.load()[0], _params(2.0))


def test_async_publish(tmp_path):
  with SnapshotPublisher(tmp_path / 's', async_save=True) as pub:
    pub.publish(1, _params(1.0), {'version': 1})
    pub.publish(2, _params(2.0), {'version': 2})
    pub.wait_until_finished()
    assert SnapshotReader(tmp_path / 's').versions() == [1, 2]
  _assert_tree_equal(SnapshotReader(tmp_path / 's').load(2)[0], _params(2.0))


def test_non_increasing_version_rejected(tmp_path):
  with SnapshotPublisher(tmp_path) as pub:
    pub.publish(3, _params())
    with pytest.raises(ValueError, match='strictly increase'):
      pub.publish(3, _params())
    with pytest.raises(ValueError, match='strictly increase'):
      pub.publish(2, _params())
    with pytest.raises(TypeError, match='JSON'):
      pub.publish(4, _params(), {'bad': object()})
    pub.publish(4, _params())  # Failed attempts do not burn a version.
  assert SnapshotReader(tmp_path).versions() == [3, 4]


def test_missing_version_error(tmp_path):
  reader = SnapshotReader(tmp_path)
  with pytest.raises(SnapshotNotFoundError, match='No snapshots'):
    reader.load()
  with SnapshotPublisher(tmp_path) as pub:
    pub.publish(1, _params())
    pub.publish(2, _params())
  with pytest.raises(SnapshotNotFoundError) as info:
    reader.load(5)
  msg = str(info.value)
  assert str(tmp_path) in msg and '5' in msg and '[1, 2]' in msg


def test_wait_for_version(tmp_path):
  reader = SnapshotReader(tmp_path)
  with pytest.raises(TimeoutError, match='>= 1'):
    reader.wait_for_version(1, timeout_s=0.1)
  with SnapshotPublisher(tmp_path) as pub:
    pub.publish(2, _params())
  assert reader.wait_for_version(1, timeout_s=1.0) == 2


def _data_files(step_dir: pathlib.Path) -> list[pathlib.Path]:
  # TensorStore/OCDBT chunk files live in directories named 'd'.
  return [p for p in step_dir.rglob('*') if p.is_file() and p.parent.name == 'd']


# A failed TensorStore read can leave a callback aimed at Orbax's already
# closed asyncio loop; it is reported at GC time and is harmless.
_IGNORE_CLOSED_LOOP = pytest.mark.filterwarnings(
    'ignore::pytest.PytestUnraisableExceptionWarning'
)


@_IGNORE_CLOSED_LOOP
@pytest.mark.parametrize('damage', ['delete', 'truncate', 'metadata'])
def test_corrupt_snapshot_error(tmp_path, damage):
  with SnapshotPublisher(tmp_path) as pub:
    pub.publish(1, _params())
  step_dir = tmp_path / '1'
  if damage == 'metadata':
    (step_dir / 'metadata' / 'metadata').write_text('{not json')
  else:
    files = _data_files(step_dir / 'params')
    assert files, list(step_dir.rglob('*'))
    for f in files:
      if damage == 'delete':
        f.unlink()
      else:
        f.write_bytes(f.read_bytes()[:3])
  with pytest.raises(SnapshotCorruptError) as info:
    SnapshotReader(tmp_path).load(1)
  assert str(tmp_path) in str(info.value) and 'version 1' in str(info.value)
  assert info.value.__cause__ is not None


def test_restore_onto_disjoint_named_sharding(tmp_path):
  devices = jax.devices()
  if len(devices) < 8:
    pytest.skip('needs 8 (forced host) devices')
  learner_mesh = jax.sharding.Mesh(np.array(devices[:4]), ('d',))
  rollout_mesh = jax.sharding.Mesh(np.array(devices[4:8]), ('d',))
  p = jax.sharding.PartitionSpec
  params = jax.device_put(
      {'w': jnp.arange(32.0).reshape(8, 4), 'b': jnp.ones((4,))},
      {
          'w': jax.sharding.NamedSharding(learner_mesh, p('d')),
          'b': jax.sharding.NamedSharding(learner_mesh, p()),
      },
  )
  with SnapshotPublisher(tmp_path) as pub:
    pub.publish(1, params, {'version': 1})

  # Per-leaf shardings on the rollout devices.
  target = snapshots.abstract_target_like(
      jax.eval_shape(lambda: params),
      {
          'w': jax.sharding.NamedSharding(rollout_mesh, p(None, 'd')),
          'b': jax.sharding.NamedSharding(rollout_mesh, p('d')),
      },
  )
  loaded, meta = SnapshotReader(tmp_path).load(1, target=target)
  meta.pop('checksums')
  assert meta == {'version': 1}
  rollout_devices = set(devices[4:8])
  for name in ('w', 'b'):
    assert loaded[name].sharding.device_set == rollout_devices
    assert loaded[name].sharding == target[name].sharding
  _assert_tree_equal(loaded, params)

  # A single sharding for all leaves; default (no target) -> one device.
  single = jax.sharding.NamedSharding(rollout_mesh, p())
  loaded, _ = SnapshotReader(tmp_path).load(
      1, target=snapshots.abstract_target_like(params, single)
  )
  assert all(
      x.sharding.device_set == rollout_devices for x in jax.tree.leaves(loaded)
  )
  loaded, _ = SnapshotReader(tmp_path).load(1)
  assert all(len(x.sharding.device_set) == 1 for x in jax.tree.leaves(loaded))
  _assert_tree_equal(loaded, params)


_WRITER = textwrap.dedent("""
    import sys
    import jax.numpy as jnp
    from jax_dora.snapshots import SnapshotPublisher

    directory, n = sys.argv[1], int(sys.argv[2])
    # Async + tight retention: finalize and garbage collection both race the
    # reader from Orbax's background thread.
    with SnapshotPublisher(directory, max_to_keep=2, async_save=True) as pub:
      for v in range(1, n + 1):
        pub.publish(v, {
            'a': jnp.full((64, 64), float(v), jnp.float32),
            'b': {'c': jnp.full((3,), float(v), jnp.float32),
                  'd': jnp.full((16, 16), float(v), jnp.bfloat16)},
        }, {'version': v})
""")


@_IGNORE_CLOSED_LOOP
def test_atomic_publish_under_concurrency(tmp_path):
  """A reader in another process never sees a partial or mixed snapshot."""
  n = 30
  env = dict(
      os.environ,
      PYTHONPATH=os.pathsep.join(
          [str(_REPO_ROOT), os.environ.get('PYTHONPATH', '')]
      ),
      XLA_FLAGS='--xla_force_host_platform_device_count=1',
  )
  writer = subprocess.Popen(
      [sys.executable, '-c', _WRITER, str(tmp_path), str(n)],
      env=env,
      stderr=subprocess.PIPE,
      text=True,
  )
  reader = SnapshotReader(tmp_path)
  seen: set[int] = set()
  vanished = 0
  deadline = time.monotonic() + 60
  try:
    reader.wait_for_version(1, timeout_s=60)
    while True:
      done = writer.poll() is not None
      versions = reader.versions()
      assert versions == sorted(set(versions)), versions
      assert len(versions) <= 3, versions  # max_to_keep=2, +1 mid-GC at most.
      loads = [None] + versions[-1:]
      for version in loads:
        try:
          params, meta = reader.load(version)
        except SnapshotNotFoundError:
          # Only legitimate when retention retired an explicitly named one.
          assert version is not None and version not in reader.versions()
          vanished += 1
          continue
        v = meta['version']
        assert version is None or v == version
        for leaf in jax.tree.leaves(params):
          np.testing.assert_array_equal(
              np.asarray(leaf, np.float32), np.float32(v)
          )
        seen.add(v)
      if done:
        break
      assert time.monotonic() < deadline, 'writer did not finish in time'
  finally:
    if writer.poll() is None:
      writer.kill()
    _, stderr = writer.communicate()
  assert writer.returncode == 0, stderr[-3000:]
  assert reader.versions() == [n - 1, n]
  assert n in seen
  # The reader must have overlapped with the writer, or the test is vacuous.
  assert len(seen) >= 3, (seen, vanished)


def test_discard_after_removes_newer_versions(tmp_path):
  """A resumed run drops versions a killed run published after its checkpoint."""
  params = {'w': np.zeros((2,), np.float32)}
  with SnapshotPublisher(tmp_path / 'snaps', max_to_keep=None) as pub:
    for v in range(4):
      pub.publish(v, {'w': params['w'] + v})
    assert pub.discard_after(1) == [2, 3]
    assert pub.last_version == 1
    pub.publish(2, {'w': params['w'] + 20})
  reader = SnapshotReader(tmp_path / 'snaps')
  assert reader.versions() == [0, 1, 2]
  loaded, _ = reader.load(2)
  np.testing.assert_allclose(np.asarray(loaded['w']), 20.0)


def test_relative_directory_is_resolved(tmp_path, monkeypatch):
  """``--config.output_dir=runs/x`` must work although Orbax wants absolute paths."""
  monkeypatch.chdir(tmp_path)
  with SnapshotPublisher('runs/rel/snapshots') as pub:
    pub.publish(0, {'w': np.ones((2,), np.float32)})
  assert SnapshotReader('runs/rel/snapshots').versions() == [0]
  assert (tmp_path / 'runs' / 'rel' / 'snapshots').is_dir()


@pytest.mark.parametrize('compress', [False, True])
def test_compressed_and_uncompressed_snapshots_read_back_the_same(tmp_path, compress):
  """``snapshots.compress``: a constant tree (highly compressible) written with the flag off
  takes at least its raw bytes on disk, with it on far fewer; either reads back bit-identical,
  checksums verified, through the one default reader (the flag is the writer's alone)."""
  params = {'w': jnp.full((256, 256), 0.5, jnp.bfloat16), 'b': jnp.zeros((4096,), jnp.float32)}
  raw = sum(x.nbytes for x in jax.tree.leaves(params))
  directory = tmp_path / 'snaps'
  with SnapshotPublisher(directory, compress=compress) as pub:
    pub.publish(1, params)
  on_disk = sum(f.stat().st_size for f in (directory / '1' / 'params').rglob('*') if f.is_file())
  if compress:
    assert on_disk < raw / 4, (on_disk, raw)
  else:
    assert on_disk >= raw, (on_disk, raw)
  loaded, _ = SnapshotReader(directory).load(1)
  _assert_tree_equal(loaded, params)
