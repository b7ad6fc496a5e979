"""Versioned policy-parameter snapshots: the learner -> rollout channel.

The learner publishes policy parameters under a monotonically increasing
``version``; rollout servers (other processes, possibly other hosts) poll the
same directory and load whichever version they need. The directory is the only
shared state, so correctness hinges on one property: a reader must never
observe a half-written snapshot. We get that from Orbax rather than inventing a
protocol:

* On local/POSIX filesystems Orbax writes each step into
  ``<step>.orbax-checkpoint-tmp-<ts>/`` and atomically renames it to ``<step>/``
  only after every item has been written (``AtomicRenameTemporaryPath``).
* On GCS, where renames are not atomic, Orbax writes ``commit_success.txt``
  last (``CommitFileTemporaryPath``) and readers ignore steps without it.

``SnapshotReader`` lists versions with the same Orbax ``NameFormat`` the
publisher uses, which applies exactly those finalization checks, so a version
is visible iff it is complete.

Retention (``max_to_keep``) is the other hazard: a reader may be loading a
version at the moment the publisher garbage-collects it. On local filesystems
we ask Orbax to *rename* doomed steps into a trash sub-directory
(``todelete_subdir``) before we delete them, so a version disappears from the
listing atomically instead of being visible while half-deleted. A load that
fails because its version vanished mid-read is reported as
``SnapshotNotFoundError`` (and retried automatically when loading the latest),
never as corruption.

**Run incarnations.** Version numbers alone do not identify parameters: a
learner resumed from its checkpoint at step N publishes a new N+1 while
servers may still hold the killed run's N+1, and a fresh run reusing a
snapshot directory starts again at 0. Every start of a run (fresh or resumed)
therefore picks a new *incarnation* id; the publisher writes it into every
version's metadata and readers asked for ``(version, incarnation)`` refuse a
snapshot of another incarnation (``SnapshotNotFoundError``) instead of
loading the wrong parameters silently.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections.abc import Collection
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from jax_dora.snapshots import checksum
from jax_dora.orbax_roles import (
  SAVE_LOCK,
  absolute_path,
  manager_kwargs,
  multiprocessing_options,
  savable,
  this_process_only,
)

_log = logging.getLogger(__name__)

PyTree = Any

_PARAMS = 'params'
_METADATA = 'metadata'
# Orbax renames garbage-collected steps here (local filesystems only); the
# leading dot keeps it out of the step-name regex so readers never list it.
_TRASH_SUBDIR = '.snapshot-trash'
# How many times ``load(None)`` chases a newer latest version when the one it
# picked is garbage-collected mid-read. Each retry implies the publisher made
# progress, so a small bound suffices.
_LATEST_RETRIES = 8



class SnapshotError(Exception):
  """Base class for snapshot-store failures."""


class SnapshotNotFoundError(SnapshotError):
  """The requested version is not (or no longer) published."""


class SnapshotCorruptError(SnapshotError):
  """A finalized version exists but cannot be read back."""


class SnapshotIntegrityError(SnapshotCorruptError):
  """A snapshot's parameters are not the ones its publisher recorded checksums of."""


def _name_format() -> ocp.step.NameFormat:
  # Publisher and reader must agree on step naming *and* on the finalization
  # checks; sharing one factory guarantees both.
  return ocp.step.standard_name_format()


def _list_versions(directory: epath.Path) -> list[int]:
  """Finalized versions in ``directory``, read from storage (never cached)."""
  last_error: Exception | None = None
  # A concurrent rename/delete by the publisher can make an entry vanish
  # between ``iterdir`` and its finalization check; a re-scan is then correct.
  for _ in range(3):
    try:
      return sorted(m.step for m in _name_format().find_all(directory))
    except FileNotFoundError as e:
      last_error = e
  raise SnapshotError(
      f'Could not list snapshots in {directory}: {last_error}'
  ) from last_error


def _is_local(directory: epath.Path) -> bool:
  return not str(directory).startswith('gs://')


class SnapshotPublisher:
  """Publishes versioned parameter snapshots into ``directory``.

  Wraps ``ocp.CheckpointManager`` with two items per version: ``params``
  (``StandardSave``; arbitrary pytree of jax/numpy arrays, sharded arrays are
  written by their owning devices) and ``metadata`` (``JsonSave``; small dict,
  e.g. training step, timestamps). Version numbers are Orbax steps.

  Atomicity comes from Orbax's tmp-dir + finalize protocol (see module
  docstring): readers in other processes only ever see fully written
  versions, which is why the publisher needs no lock or side channel.

  There must be a single publisher per directory: versions must strictly
  increase (a rollout server that saw version ``v`` must never see a
  different ``v`` later), and the publisher cleans up stale tmp dirs from a
  crashed predecessor on start-up.
  """

  def __init__(
      self,
      directory: str | epath.Path,
      max_to_keep: int | None = 4,
      async_save: bool = False,
      processes: Collection[int] | None = None,
      incarnation: str | None = None,
      checksum_casts: Collection[str] = (),
      write_dtype: str | None = None,
      compress: bool = False,
  ):
    """Opens (creating if needed) the snapshot directory.

    Args:
      directory: Local path or ``gs://`` URL shared with the readers.
      max_to_keep: Number of newest versions retained; ``None`` keeps all.
        Readers lagging further behind than this get ``SnapshotNotFoundError``.
      async_save: If True, ``publish`` returns once arrays are copied off the
        device and the write/finalize happens in a background thread, so the
        learner can keep training. Call ``wait_until_finished`` to block.
      processes: Under ``jax.distributed``, the processes that publish
        together (the learner's); ``None`` means every process of the
        cluster. Readers never take part (see ``multiprocessing_options``).
      incarnation: The run incarnation written into every version's metadata
        (see the module docstring); ``None`` writes none.
      checksum_casts: Dtypes readers restore into (``rollout.param_dtype``):
        besides the published tree's checksums, every version records the
        checksums of the tree cast to each, so a server holding a cast copy
        can verify it too (``jax_dora.snapshots.checksum``).
      write_dtype: Cast every floating leaf to this dtype (on its devices)
        before writing: what the servers restore (``rollout.param_dtype``),
        half the bytes of float32 master weights for bfloat16 servers.
        ``None`` writes the tree as handed over. The version's checksums are
        then those of the written tree.
      compress: zstd-compress the written chunks (Orbax's default). Off by
        default: a version is written every step and read once per server,
        and weights compress by ~22% at ~1.7x the write time on CPU
        (``orbax_roles.standard_handler``). Readers decode either.
    """
    self.incarnation = incarnation
    self.checksum_casts = tuple(checksum_casts)
    self.write_dtype = write_dtype or None
    self._async = bool(async_save)
    if max_to_keep is not None and max_to_keep < 1:
      raise ValueError(f'max_to_keep must be >= 1 or None, got {max_to_keep}')
    self._directory = absolute_path(directory)
    self._local = _is_local(self._directory)
    manager_kw, options_kw = manager_kwargs(
        self._directory,
        multiprocessing_options(processes, 'jax_dora_snapshots'),
        _PARAMS,
        _METADATA,
        compress=compress,
    )
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        enable_async_checkpointing=async_save,
        step_name_format=_name_format(),
        # Leftover ``*.orbax-checkpoint-tmp-*`` dirs are from a crashed
        # publisher; they are invisible to readers but waste space.
        cleanup_tmp_directories=True,
        todelete_subdir=_TRASH_SUBDIR if self._local else None,
        **options_kw,
    )
    self._manager = ocp.CheckpointManager(
        self._directory, options=options, **manager_kw
    )
    # Orbax removes a crashed predecessor's tmp dirs in a background thread and
    # only awaits that at the first save; finish it now so that start-up
    # leaves the directory clean (and a reused version number cannot race it).
    await_cleanup = getattr(self._manager, '_maybe_await_cleanup_tmp_directory', None)
    if await_cleanup is not None:
      await_cleanup()
    existing = self._manager.all_steps()
    self._last_version: int | None = max(existing) if existing else None
    self._closed = False

  @property
  def directory(self) -> epath.Path:
    return self._directory

  @property
  def last_version(self) -> int | None:
    """Highest version published (including ones found on disk at start)."""
    return self._last_version

  def checksum_record(self, written: PyTree) -> dict[str, Any]:
    """The checksums a version's metadata carries for the tree ``written`` (already cast to
    ``write_dtype``): its own, and the tree cast to each other reader dtype."""
    dtypes = {jax.numpy.dtype(x.dtype).name for x in jax.tree.leaves(written)}
    casts = tuple(c for c in self.checksum_casts if jax.numpy.dtype(c).name not in dtypes)
    return checksum.record(written, casts)

  def cast_for_writing(self, params: PyTree) -> PyTree:
    """``params`` in ``write_dtype`` (floating leaves; a jitted cast where they live)."""
    if self.write_dtype is None:
      return params
    dtype = jax.numpy.dtype(self.write_dtype)
    if all(x.dtype == dtype or not jax.numpy.issubdtype(x.dtype, jax.numpy.floating)
           for x in jax.tree.leaves(params)):
      return params
    return _cast_floating(params, dtype)

  def publish(
      self, version: int, params: PyTree, metadata: dict[str, Any] | None = None,
      checksums: dict[str, Any] | None = None, owned: bool = False,
  ) -> None:
    """Writes ``params`` as ``version``; visible to readers once finalized.

    ``owned`` (a detached copy nobody else holds, as the in-memory transport
    takes it) changes nothing here: the tree is written, never kept.

    Args:
      version: Non-negative int, strictly greater than any published before.
      params: Pytree of arrays. Sharded ``jax.Array``s are fine.
      metadata: JSON-serializable dict stored alongside the params.
      checksums: The record of the tree as written, if the caller computed it
        already (the in-memory transport does, once per version).

    Raises:
      ValueError: ``version`` is not strictly increasing / not an int.
      TypeError: ``metadata`` is not a JSON-serializable dict.
      SnapshotError: the publisher is closed or Orbax declined to save.
    """
    if self._closed:
      raise SnapshotError(f'Publisher for {self._directory} is closed.')
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)):
      raise ValueError(f'version must be an int, got {version!r}')
    version = int(version)
    if version < 0:
      raise ValueError(f'version must be >= 0, got {version}')
    if self._last_version is not None and version <= self._last_version:
      raise ValueError(
          f'Snapshot versions must strictly increase in {self._directory}: '
          f'got {version} after {self._last_version}.'
      )
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict):
      raise TypeError(f'metadata must be a dict, got {type(metadata)}')
    if self.incarnation is not None:
      metadata = dict(metadata, incarnation=self.incarnation)
    del owned
    params = self.cast_for_writing(params)
    # What readers verify the restored tree against: computed here, from the
    # tree handed over, on its devices (one read of the parameters).
    if checksums is None:
      checksums = self.checksum_record(params)
    metadata = dict(metadata, checksums=checksums)
    # Fail here, with a clear message, rather than inside Orbax's (possibly
    # background) writer after the params are already half written.
    try:
      json.dumps(metadata)
    except (TypeError, ValueError) as e:
      raise TypeError(f'metadata is not JSON-serializable: {e}') from e

    self._purge_trash()
    with SAVE_LOCK:  # see orbax_roles.SAVE_LOCK
      saved = self._manager.save(
          version,
          args=ocp.args.Composite(**{
              _PARAMS: ocp.args.StandardSave(savable(params)),
              _METADATA: ocp.args.JsonSave(metadata),
          }),
          force=True,
      )
      if not self._async:
        self._manager.wait_until_finished()
    if not saved:
      raise SnapshotError(
          f'Orbax declined to save version {version} in {self._directory}.'
      )
    self._last_version = version

  def discard_after(self, version: int) -> list[int]:
    """Deletes every version newer than ``version``; returns what it removed.

    Used when a run resumes from a checkpoint taken at ``version``: snapshots
    the killed run published afterwards belong to a discarded future and must
    not be mistaken for the resumed run's versions of the same number.
    """
    self._manager.wait_until_finished()
    self._manager.reload()
    removed = sorted(v for v in self._manager.all_steps() if v > version)
    for v in removed:
      self._manager.delete(v)
    self._purge_trash()
    if removed:
      _log.warning('Discarded snapshot versions %s newer than %d', removed, version)
    remaining = self._manager.all_steps()
    self._last_version = max(remaining) if remaining else None
    return removed

  def wait_until_finished(self) -> None:
    """Blocks until every pending (async) publish is finalized."""
    self._manager.wait_until_finished()
    self._purge_trash()

  def close(self) -> None:
    """Finishes pending writes and releases Orbax resources. Idempotent."""
    if self._closed:
      return
    self._manager.wait_until_finished()
    self._manager.close()
    self._purge_trash()
    self._closed = True

  def __enter__(self) -> SnapshotPublisher:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  def _purge_trash(self) -> None:
    """Physically deletes versions Orbax already (atomically) retired.

    Only the trash's children are removed, never the trash dir itself,
    because Orbax may be renaming into it from its background thread.
    """
    if not self._local:
      return
    trash = self._directory / _TRASH_SUBDIR
    try:
      if not trash.exists():
        return
      for entry in trash.iterdir():
        entry.rmtree(missing_ok=True)
    except OSError as e:  # Best effort: leftovers cost disk, not correctness.
      _log.warning('Could not purge %s: %s', trash, e)


@functools.partial(jax.jit, static_argnums=1)
def _cast_floating(params: PyTree, dtype) -> PyTree:
  return jax.tree.map(
      lambda x: x.astype(dtype) if jax.numpy.issubdtype(x.dtype, jax.numpy.floating) else x, params)


def as_reader(source: Any, verify_checksums: bool = True) -> Any:
  """A reader for ``source``: a snapshot directory (a new ``SnapshotReader``), or a reader
  already built (the in-memory transport's ``TieredReader``), passed through."""
  if hasattr(source, 'load') and hasattr(source, 'read_metadata'):
    return source
  return SnapshotReader(source, verify_checksums=verify_checksums)


def abstract_target_like(
    params: PyTree, sharding: jax.sharding.Sharding | PyTree
) -> PyTree:
  """Builds a restore target: ``ShapeDtypeStruct``s of ``params`` + sharding.

  Rollout servers restore onto their own devices (disjoint from the
  learner's), so they need a target that carries shape/dtype of the policy
  and *their* shardings, without allocating anything.

  Args:
    params: Pytree whose leaves have ``.shape``/``.dtype`` (arrays or
      ``ShapeDtypeStruct``s), e.g. from ``jax.eval_shape(init_fn)``.
    sharding: One ``jax.sharding.Sharding`` for every leaf, or a pytree of
      shardings with the same structure as ``params``.

  Returns:
    Pytree of ``jax.ShapeDtypeStruct`` with ``sharding`` set.
  """

  def make(leaf: Any, s: jax.sharding.Sharding) -> jax.ShapeDtypeStruct:
    dtype = leaf.dtype if hasattr(leaf, 'dtype') else np.asarray(leaf).dtype
    return jax.ShapeDtypeStruct(np.shape(leaf), dtype, sharding=s)

  if isinstance(sharding, jax.sharding.Sharding):
    return jax.tree.map(lambda leaf: make(leaf, sharding), params)
  return jax.tree.map(make, params, sharding)


class SnapshotReader:
  """Reads snapshots published by a ``SnapshotPublisher``, possibly elsewhere.

  Stateless with respect to the directory: every call re-scans storage,
  because the publisher lives in another process and any cache would be
  stale. Safe to use from several threads.
  """

  def __init__(self, directory: str | epath.Path, verify_checksums: bool = True):
    """``verify_checksums``: check every loaded tree against the checksums its
    publisher recorded (``SnapshotIntegrityError`` on a difference)."""
    self._directory = absolute_path(directory)
    self.verify_checksums = bool(verify_checksums)
    # Loads refused because the restored tree is not the published one.
    self.integrity_failures = 0
    # One Orbax Checkpointer for every load (a Checkpointer, unlike a
    # CheckpointManager, caches no step list, so it never goes stale):
    # constructing one per load was half the cost of loading a small policy,
    # and servers load every version the learner publishes. Loads through
    # it are serialised.
    self._checkpointer: ocp.Checkpointer | None = None
    self._restore_lock = threading.Lock()

  @property
  def directory(self) -> epath.Path:
    return self._directory

  def versions(self) -> list[int]:
    """Finalized versions, ascending. Empty if the directory is absent."""
    return _list_versions(self._directory)

  def latest_version(self) -> int | None:
    versions = self.versions()
    return versions[-1] if versions else None

  def _step_path(self, version: int) -> epath.Path:
    return ocp.step.build_step_path(self._directory, _name_format(), int(version))

  def has_version(self, version: int) -> bool:
    """Whether ``version`` is published and finalized (one stat, no listing)."""
    path = self._step_path(version)
    try:
      return path.exists() and ocp.step.is_checkpoint_finalized(path)
    except (FileNotFoundError, ValueError):
      return False  # removed (or being removed) by the publisher's retention

  def wait_for_version(
      self, min_version: int, timeout_s: float, poll_s: float = 0.05
  ) -> int:
    """Polls until some version >= ``min_version`` is finalized.

    Returns:
      The latest version at that moment (>= ``min_version``).

    Raises:
      TimeoutError: nothing new enough appeared within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
      latest = self.latest_version()
      if latest is not None and latest >= min_version:
        return latest
      remaining = deadline - time.monotonic()
      if remaining <= 0:
        raise TimeoutError(
            f'No snapshot version >= {min_version} in {self._directory} '
            f'after {timeout_s:.3f}s (latest: {latest}).'
        )
      time.sleep(min(poll_s, remaining))

  def load(
      self,
      version: int | None = None,
      target: PyTree | None = None,
      incarnation: str | None = None,
  ) -> tuple[PyTree, dict[str, Any]]:
    """Loads ``(params, metadata)`` of ``version`` (default: latest).

    Args:
      version: Version to load; ``None`` means the latest. With ``None`` a
        version garbage-collected mid-read is retried with the new latest.
      target: Optional pytree of ``jax.ShapeDtypeStruct`` (see
        ``abstract_target_like``) or arrays whose shardings say where to put
        each leaf. If ``None``, leaves land on the default device: the saved
        shardings name the *publisher's* devices, which need not exist here.
      incarnation: If given, the run incarnation the version must belong to.

    Raises:
      SnapshotNotFoundError: no such (or no) finalized version, or one of
        another incarnation than ``incarnation``.
      SnapshotCorruptError: the version is listed but unreadable; the Orbax /
        TensorStore / JSON exception is chained as ``__cause__``.
    """
    if version is not None:
      params, metadata = self._load_version(int(version), target)
      self._check_incarnation(int(version), metadata, incarnation)
      self._verify(int(version), params, metadata)
      return params, metadata
    for _ in range(_LATEST_RETRIES):
      latest = self.latest_version()
      if latest is None:
        raise SnapshotNotFoundError(
            f'No snapshots published in {self._directory} yet.'
        )
      try:
        params, metadata = self._load_version(latest, target)
      except SnapshotNotFoundError:
        continue  # Retired while we read it; a newer one exists.
      self._check_incarnation(latest, metadata, incarnation)
      self._verify(latest, params, metadata)
      return params, metadata
    raise SnapshotNotFoundError(
        f'Latest snapshot in {self._directory} kept being garbage-collected '
        f'while loading ({_LATEST_RETRIES} attempts); the reader is too slow '
        'for the publisher\'s max_to_keep.'
    )

  def read_metadata(self, version: int) -> dict[str, Any]:
    """The JSON metadata of ``version`` alone (no params are read)."""
    if not self.has_version(version):
      raise SnapshotNotFoundError(
          f'Snapshot version {version} not found in {self._directory}; '
          f'available versions: {self.versions()}.'
      )
    try:
      with self._restore_lock:
        if self._checkpointer is None:
          self._checkpointer = self._make_checkpointer()
        restored = self._checkpointer.restore(
            self._step_path(version),
            args=ocp.args.Composite(**{_METADATA: ocp.args.JsonRestore()}),
        )
      return dict(restored[_METADATA])
    except Exception as e:  # pylint: disable=broad-exception-caught
      if version not in self.versions():
        raise SnapshotNotFoundError(
            f'Snapshot version {version} in {self._directory} was removed while reading it.'
        ) from e
      raise SnapshotCorruptError(
          f'Snapshot version {version} in {self._directory}: unreadable metadata:'
          f' {type(e).__name__}: {e}'
      ) from e

  def _verify(self, version: int, params: PyTree, metadata: dict[str, Any]) -> None:
    """Raises ``SnapshotIntegrityError`` unless ``params`` are what the publisher recorded.

    Versions published before checksums existed carry none and pass.
    """
    tables = metadata.get('checksums')
    if not self.verify_checksums or not tables:
      return
    problem, unverified = checksum.first_mismatch(checksum.checksums(params), tables)
    if problem is not None:
      self.integrity_failures += 1
      raise SnapshotIntegrityError(
          f'Snapshot version {version} in {self._directory} does not hold the parameters its'
          f' publisher recorded: {problem}. Refusing to load it.'
      )
    if unverified:
      _log.debug('snapshot version %d: %d leaves restored in a dtype without a recorded'
                 ' checksum, not verified', version, unverified)

  def _check_incarnation(
      self, version: int, metadata: dict[str, Any], incarnation: str | None
  ) -> None:
    if incarnation is None:
      return
    found = metadata.get('incarnation')
    if found != incarnation:
      raise SnapshotNotFoundError(
          f'Snapshot version {version} in {self._directory} belongs to run incarnation'
          f' {found!r}, not {incarnation!r}: another run (or a killed incarnation of this'
          ' one) published it; the current incarnation has not published this version.'
      )

  def _load_version(
      self, version: int, target: PyTree | None
  ) -> tuple[PyTree, dict[str, Any]]:
    if not self.has_version(version):
      raise SnapshotNotFoundError(
          f'Snapshot version {version} not found in {self._directory}; '
          f'available versions: {self.versions()}.'
      )
    path = self._step_path(version)
    try:
      params, metadata = self._restore(path, target)
      if not isinstance(metadata, dict):
        raise TypeError(f'metadata is {type(metadata)}, expected dict')
    except Exception as e:  # pylint: disable=broad-exception-caught
      # Distinguish "retired under our feet" (normal under retention) from
      # genuine damage: only the latter still lists the version.
      still_there = self.versions()
      if version not in still_there:
        raise SnapshotNotFoundError(
            f'Snapshot version {version} in {self._directory} was removed '
            f'while loading; available versions: {still_there}.'
        ) from e
      raise SnapshotCorruptError(
          f'Snapshot version {version} in {self._directory} is corrupt or '
          f'incompatible with the restore target: {type(e).__name__}: {e}'
      ) from e
    return params, metadata

  def _restore(
      self, path: epath.Path, target: PyTree | None
  ) -> tuple[PyTree, Any]:
    with self._restore_lock:
      if self._checkpointer is None:
        self._checkpointer = self._make_checkpointer()
      checkpointer = self._checkpointer
      if target is None:
        tree = checkpointer.metadata(path).item_metadata[_PARAMS]
        if tree is None:
          raise ValueError(f'No params metadata under {path}')
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        target = jax.tree.map(
            lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
            tree.tree if hasattr(tree, 'tree') else tree,
        )
      restored = checkpointer.restore(
          path,
          args=ocp.args.Composite(**{
              _PARAMS: ocp.args.StandardRestore(target),
              _METADATA: ocp.args.JsonRestore(),
          }),
      )
    return restored[_PARAMS], restored[_METADATA]

  @staticmethod
  def _make_checkpointer() -> ocp.Checkpointer:
    mp = this_process_only('jax_dora_snapshot_reader')
    if mp is None:
      checkpointer = ocp.Checkpointer(
          ocp.CompositeCheckpointHandler(**{
              _PARAMS: ocp.StandardCheckpointHandler(),
              _METADATA: ocp.JsonCheckpointHandler(),
          })
      )
    else:
      # Under jax.distributed a reader restores alone: no barrier with the
      # learner's processes (or other servers), no primary-host-only reads.
      checkpointer = ocp.Checkpointer(
          ocp.CompositeCheckpointHandler(
              composite_options=ocp.CompositeOptions(multiprocessing_options=mp),
              **{
                  _PARAMS: ocp.StandardCheckpointHandler(multiprocessing_options=mp),
                  _METADATA: ocp.JsonCheckpointHandler(multiprocessing_options=mp),
              },
          ),
          multiprocessing_options=mp,
      )
    return checkpointer
