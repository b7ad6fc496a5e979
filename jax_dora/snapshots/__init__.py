"""Versioned policy snapshots: how the learner hands parameters to rollout servers."""

from jax_dora.snapshots.store import abstract_target_like
from jax_dora.snapshots.store import as_reader
from jax_dora.snapshots.store import SnapshotCorruptError
from jax_dora.snapshots.store import SnapshotError
from jax_dora.snapshots.store import SnapshotIntegrityError
from jax_dora.snapshots.store import SnapshotNotFoundError
from jax_dora.snapshots.store import SnapshotPublisher
from jax_dora.snapshots.store import SnapshotReader

__all__ = [
    'SnapshotCorruptError',
    'SnapshotError',
    'SnapshotIntegrityError',
    'SnapshotNotFoundError',
    'SnapshotPublisher',
    'SnapshotReader',
    'abstract_target_like',
    'as_reader',
]
