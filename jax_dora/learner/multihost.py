"""One orchestrator, several learner processes: the multi-host learner protocol.

A learner that spans several processes (the hosts of a TPU slice, or local
processes in a CPU test) runs one jitted train step over a global mesh. Every
process must make that call with the *identical* global batch, and make every
other call that involves the learner's arrays or Orbax barriers (a publish, a
run checkpoint, the params copy of a background publish) in the same order.
Only one process may draw prompts, dispatch rollouts, assemble batches and
decide when to publish: with one orchestrator per process, request ids collide
on the servers, each process feeds its own batch into one global array, and
background publishes diverge (mismatched Orbax barriers).

So the *primary* learner process (the lowest process id of the learner) runs
the orchestrator, and drives the others through :class:`LeaderLearner` and
:class:`LeaderPublisher`, drop-in stand-ins for the learner and the snapshot
publisher that first broadcast each operation (and its batch) to the learner
processes. Every other learner process runs :func:`follow`: it receives the
operations in order and makes the same calls.

Operations travel as small headers through the ``jax.distributed`` key-value
store (host memory of the coordination service), one key per operation in
order; only their payloads (a train step's batch) use the device-collective
trick of ``jax.experimental.multihost_utils.broadcast_one_to_all`` (the source
contributes its data, the others zeros, one ``psum``) restricted to the
learner's devices: the ``jax.distributed`` cluster may also hold rollout-server
processes, which must never take part in a learner collective. Why headers are
not collectives: a follower waiting for the next operation inside a device
collective keeps it queued on its devices, and on the CPU client the
device-to-host copy of its background publish (bfloat16 shards) queued behind
it, while the primary's publish waited at Orbax's barrier for that copy: a
multi-process learner writing bfloat16 versions hung at its second version.
A follower waiting on the key-value store holds nothing on its devices; it
enters a collective only after the primary has announced it.

Ordering: every broadcast, and every train step, runs under one lock on the
primary, so no broadcast can slip between the collectives of a train step
that a follower runs strictly after it. A publish or checkpoint broadcasts
under the process's Orbax save lock and saves before releasing it, so the
primary's saves happen in broadcast order; a follower publishes a background
copy in a serial worker thread, waits for it before a checkpoint, and does
everything else inline, so its Orbax saves come in the same order (Orbax
barriers pair them up across processes).
"""

from __future__ import annotations

import concurrent.futures
import enum
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_dora.learner.train_state import TrainingDivergedError
from jax_dora.orbax_roles import SAVE_LOCK

log = logging.getLogger(__name__)

_HEADER = 4  # int64 words: op, arg0, arg1, arg2
_OPS_KEY = "jax_dora/learner_ops"  # + "/<sequence number>": one key per operation
_WAIT_MS = 60_000  # a follower's key-value wait, renewed (the primary may idle for minutes)


class Op(enum.IntEnum):
  TRAIN = 1  # arg0 = rows, arg1 = seq_len; the batch follows
  COPY = 2  # arg0 = version: detached params copy for a background publish
  PUBLISH = 3  # arg0 = version
  CHECKPOINT = 4  # arg0 = step
  STOP = 5  # arg0 = 1 if the primary failed


class LearnerGroup:
  """The learner's processes and a one-to-all broadcast over their devices only."""

  def __init__(self, devices: Sequence[jax.Device]):
    by_process: dict[int, list[jax.Device]] = {}
    for d in devices:
      by_process.setdefault(d.process_index, []).append(d)
    self.processes = sorted(by_process)
    self.primary = self.processes[0]
    self.is_primary = jax.process_index() == self.primary
    self.size = len(self.processes)
    self.lock = threading.RLock()
    self._sent = 0  # operations announced (primary) / received (follower)
    self._mesh: Mesh | None = None
    if self.size > 1:
      per = min(len(v) for v in by_process.values())
      grid = np.array([sorted(by_process[p], key=lambda d: d.id)[:per] for p in self.processes])
      self._mesh = Mesh(grid, ("processes", "local"))

  @property
  def multi_process(self) -> bool:
    return self.size > 1

  def broadcast(self, tree: Any) -> Any:
    """``tree`` (numpy arrays of identical shapes everywhere) as the primary has it."""
    if self._mesh is None:
      return tree
    mesh = self._mesh

    def pre(x):
      x = np.asarray(x)
      inp = x if self.is_primary else np.zeros_like(x)
      return multihost_utils.host_local_array_to_global_array(inp[None], mesh, P("processes"))

    with self.lock:
      out = jax.jit(
          lambda xs: jax.tree.map(lambda x: jnp.sum(x, axis=0, dtype=x.dtype), xs),
          out_shardings=NamedSharding(mesh, P()),
      )(jax.tree.map(pre, tree))
      return jax.tree.map(lambda x: np.asarray(jax.device_get(x.addressable_data(0))), out)

  def broadcast_text(self, text: str, max_len: int = 256) -> str:
    """A short string from the primary (e.g. the run incarnation id)."""
    raw = np.zeros((max_len,), np.uint8)
    data = text.encode()[:max_len] if self.is_primary else b""
    raw[:len(data)] = np.frombuffer(data, np.uint8)
    out = self.broadcast(raw)
    return bytes(out[out != 0]).decode()

  def send(self, op: Op, *args: int) -> None:
    """Announces ``op`` to the followers (the key-value store: see the module docstring)."""
    if len(args) >= _HEADER:
      raise ValueError(f"{op.name} takes at most {_HEADER - 1} int arguments, got {args}")
    self._sent += 1
    _kv_client().key_value_set(f"{_OPS_KEY}/{self._sent}",
                               " ".join(str(int(x)) for x in (int(op), *args)))

  def receive(self) -> tuple[Op, list[int]]:
    """The primary's next operation, waiting for it as long as it takes."""
    self._sent += 1
    key = f"{_OPS_KEY}/{self._sent}"
    client = _kv_client()
    while True:
      try:
        raw = client.blocking_key_value_get(key, _WAIT_MS)
        break
      except Exception as e:  # pylint: disable=broad-exception-caught
        if "DEADLINE_EXCEEDED" not in str(e):
          raise
    words = [int(x) for x in raw.split()]
    return Op(words[0]), words[1:] + [0] * (_HEADER - len(words))


def _kv_client():
  """The ``jax.distributed`` coordination service's client (its key-value store)."""
  from jax._src import distributed  # pylint: disable=g-import-not-at-top

  client = distributed.global_state.client
  if client is None:
    raise RuntimeError("multi-process learner without jax.distributed initialised")
  return client


class LeaderLearner:
  """The primary's learner: broadcasts each train step (and copy) first."""

  def __init__(self, learner: Any, group: LearnerGroup):
    self._learner = learner
    self._group = group

  def __getattr__(self, name: str) -> Any:
    return getattr(self._learner, name)

  def train_step(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
    rows, t = batch["inputs"].shape
    with self._group.lock:
      self._group.send(Op.TRAIN, rows, t + 1)
      self._group.broadcast(batch)
      return self._learner.train_step(batch)

  def detached_params(self, version: int, dtype: str | None = None) -> Any:
    # The followers cast to their own publisher's write dtype: the same config, so ``dtype``.
    with self._group.lock:
      self._group.send(Op.COPY, version)
      return self._learner.detached_params(version, dtype)


class LeaderPublisher:
  """The primary's snapshot publisher: every learner process publishes together."""

  def __init__(self, publisher: Any, group: LearnerGroup):
    self._publisher = publisher
    self._group = group

  def __getattr__(self, name: str) -> Any:
    return getattr(self._publisher, name)

  def publish(self, version: int, params: Any, metadata: dict[str, Any] | None = None,
              owned: bool = False) -> None:
    # Under the process's Orbax save lock from the broadcast on: the
    # followers make their saves in broadcast order, so ours must too.
    with SAVE_LOCK:
      self._group.send(Op.PUBLISH, version)
      self._publisher.publish(version, params, metadata, owned=owned)


def leader_checkpoint(checkpoint_fn: Callable[..., None], group: LearnerGroup) -> Callable[..., None]:
  """Wraps the run-checkpoint function: the followers save their shards with it."""

  def save(step: int, *args: Any) -> None:
    with SAVE_LOCK:  # saves in broadcast order (see LeaderPublisher.publish)
      group.send(Op.CHECKPOINT, step)
      checkpoint_fn(step, *args)

  return save


def stop_followers(group: LearnerGroup, failed: bool) -> None:
  if group.multi_process and group.is_primary:
    group.send(Op.STOP, int(failed))


def follow(
    group: LearnerGroup,
    learner: Any,
    publisher: Any,
    save_checkpoint: Callable[[int], None],
) -> bool:
  """A non-primary learner process: mirrors the primary's operations until STOP.

  Returns False if the primary reported a failure.
  """
  copies: dict[int, Any] = {}
  io = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="follower_publish")
  pending: list[concurrent.futures.Future] = []
  steps = 0
  try:
    while True:
      op, args = group.receive()
      if op is Op.TRAIN:
        rows, seq_len = args[0], args[1]
        batch = group.broadcast(learner.batch_template(rows, seq_len))
        try:
          learner.train_step(batch)
        except TrainingDivergedError as e:
          # The primary sees the same non-finite step and stops the run: keep
          # listening for its STOP instead of leaving it alone in a broadcast.
          log.error("learner follower: %s", e)
        steps += 1
      elif op is Op.COPY:
        copies[args[0]] = learner.detached_params(args[0],
                                                  getattr(publisher, "write_dtype", None))
      elif op is Op.PUBLISH:
        version = args[0]
        params = copies.pop(version, None)
        for v in [v for v in copies if v < version]:
          del copies[v]  # coalesced away by the primary's publish loop
        if params is None:
          # The primary publishes the live params before its next step: so
          # must we, before the next (donating) train step.
          publisher.publish(version, learner.params, {"step": version})
        else:
          pending.append(io.submit(publisher.publish, version, params, {"step": version}))
      elif op is Op.CHECKPOINT:
        for f in pending:
          f.result()
        pending.clear()
        save_checkpoint(args[0])
      elif op is Op.STOP:
        log.info("learner follower: %d steps mirrored; primary %s", steps,
                 "failed" if args[0] else "finished")
        return not args[0]
  finally:
    for f in pending:
      f.result()
    io.shutdown(wait=True)
