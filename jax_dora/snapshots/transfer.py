"""Versions to rollout servers in other processes through JAX's transfer server, no files.

``snapshots.transport=transfer_server``: the learner keeps each version in
memory (``TransportPublisher``, as for embedded servers) and, when it tells a
remote server to load version v (``LoadVersion`` over gRPC), offers that
version's arrays on its transfer server (``jax.experimental.transfer``) under
a fresh id; the server pulls them straight onto its devices and verifies the
checksums carried in the request before serving, exactly as a file restore is
verified. Orbax still receives every ``snapshots.durable_every``-th version:
a restarted server starts from the newest durable version and is then offered
the current one.

What the installed JAX supports (found out on the 2-core CPU, jax 0.10.2):
``start_transfer_server`` runs on the CPU backend and a pull from another
process moves the bytes; a pull cannot reshard: the puller's shardings must
have the offer's layout (the same mesh shape and partition specs; other
devices are fine), otherwise the transfer fails ("Async transfer object was
deleted before transfers completed"). So the learner first stages its copy
(through the host) on ``tensor_parallel`` of its own devices in the server's layout
(``EnginePlacement``'s specs), and the server pulls onto ``tensor_parallel``
of its devices and spreads the result over the rest of its mesh (its
``slots`` axis replicates parameters). On TPU/GPU the same API moves the
shards device to device over the network (DCN) without a host copy where the
runtime supports it; it needs the learner's address reachable from the
servers (``snapshots.transfer_host``). The runtime stages each version once, at
publish (``TransportPublisher(serve_layout=TransferOffers.stage)``): the
in-memory version is kept in the offer layout, so every server is offered it
as it is and the learner never holds a second copy. Not done: multi-process learners (the
offer would need every learner process's shards).
"""

from __future__ import annotations

import copy
import itertools
import logging
import os
import threading
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jax_dora.snapshots.memory import MemorySnapshots, place_verified
from jax_dora.snapshots.store import SnapshotNotFoundError

_log = logging.getLogger(__name__)

PyTree = Any


def start_server(host: str):
  """A JAX transfer server bound to ``host`` (an address the other side can reach)."""
  from jax.experimental import transfer  # pylint: disable=g-import-not-at-top

  return transfer.start_transfer_server(jax.devices()[0].client, f"{host}:0", [f"{host}:0"])


def _sub_mesh_sharding(sharding: NamedSharding, devices: list[jax.Device]) -> NamedSharding:
  """``sharding``'s specs on a ``(1, tensor)`` mesh of ``devices``: the layout offers use."""
  mesh = Mesh(np.array(devices).reshape(1, len(devices)), ("slots", "tensor"))
  return NamedSharding(mesh, sharding.spec)


class TransferOffers:
  """The learner's side: offers in-memory versions for remote servers to pull."""

  def __init__(self, memory: MemorySnapshots, model_cfg: Any, devices: list[jax.Device],
               host: str):
    self.memory = memory
    self.model_cfg = model_cfg
    self.devices = list(devices)
    self._server = start_server(host)
    self.address = self._server.address()
    # Ids unique across learner restarts: a server never pulls an old offer by mistake.
    self._ids = itertools.count(int.from_bytes(os.urandom(3), "little") << 24)
    self._lock = threading.Lock()
    self._layouts: dict[int, PyTree] = {}
    self.offered = 0
    self.staged = self.offered_as_is = 0  # leaves copied into an offer's layout / offered as is

  def _layout(self, tp: int) -> PyTree:
    """The servers' parameter shardings on ``tp`` learner devices."""
    from jax_dora.rollout.placement import EnginePlacement  # pylint: disable=g-import-not-at-top

    if tp not in self._layouts:
      if tp > len(self.devices):
        raise ValueError(f"servers use tensor_parallel={tp}, the learner has"
                         f" {len(self.devices)} devices to stage an offer on")
      placement = EnginePlacement(self.model_cfg, self.devices[:tp], num_slots=1,
                                  tensor_parallel=tp)
      self._layouts[tp] = placement.param_sharding
    return self._layouts[tp]

  def _stage(self, x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """``x`` in the offer layout ``sharding``: ``x`` itself when it already has that layout,
    else a copy through the host."""
    # Exactly the offer's sharding (a version staged at publish), or one device (a learner
    # mesh of another shape but one device: a pull with it was tested); other multi-device
    # layouts must match the puller's mesh shape too.
    if x.sharding == sharding or (len(x.sharding.device_set) == 1
                                  and x.sharding.is_equivalent_to(sharding, x.ndim)):
      self.offered_as_is += 1
      return x
    self.staged += 1
    return jax.device_put(jax.device_get(x), sharding)

  def stage(self, params: PyTree, tensor_parallel: int) -> PyTree:
    """``params`` in the servers' layout on ``tensor_parallel`` learner devices, leaf by leaf.

    ``TransportPublisher(serve_layout=...)`` calls it once per version at publish,
    so the in-memory version *is* the offer: every server's LoadVersion then offers
    it as it is (no staging per server, and one copy of the version kept on the
    learner, not the served copy plus an offer per server). The copy it was staged
    from is freed when the publish returns, not leaf by leaf: deleting leaves as
    they are staged lowered the peak by that copy but cost ~2 s per 0.5B version on
    this VM (freed memory goes back to the hypervisor; DESIGN, "Snapshots").
    """
    # Through the host: a direct device_put from the learner's mesh onto another device set
    # failed inside JAX in a long-lived process (an array reporting 8 shards for a 4-device
    # sharding, fresh-clone CI 12-07), and the copy is what a file would cost minus the disk.
    # Leaf by leaf, so the host holds one leaf at a time, not a second copy of the tree (at
    # 1.5B the whole-tree round trip put the benchmark's learner out of memory on 24 GB).
    return jax.tree.map(self._stage, params, self._layout(int(tensor_parallel)))

  def offer(self, version: int, tensor_parallel: int) -> dict[str, Any]:
    """Offers ``version`` in the servers' layout (staged now unless it was at publish) and
    returns what ``LoadVersion`` carries."""
    params, metadata = self.memory.get(version)
    staged = self.stage(params, tensor_parallel)
    with self._lock:
      uid = next(self._ids)
      self._server.await_pull(uid, staged)
      self.offered += 1
    dtypes = {str(x.dtype) for x in jax.tree.leaves(staged)}
    return {"address": self.address, "uuid": uid, "tensor_parallel": int(tensor_parallel),
            "dtypes": sorted(dtypes), "metadata": copy.deepcopy(metadata)}


class TransferSource:
  """The server's side: a one-version reader that pulls an offer (``SnapshotReader`` look-alike
  for ``EnginePlacement.load_params``)."""

  _server = None
  _server_lock = threading.Lock()

  def __init__(self, offer: dict[str, Any], version: int, host: str = "127.0.0.1"):
    self.offer = offer
    self.version = int(version)
    self.host = host
    self.metadata = dict(offer.get("metadata") or {})

  @classmethod
  def _local_server(cls, host: str):
    with cls._server_lock:
      if cls._server is None:
        cls._server = start_server(host)
      return cls._server

  def has_version(self, version: int) -> bool:
    return int(version) == self.version

  def read_metadata(self, version: int) -> dict[str, Any]:
    if int(version) != self.version:
      raise SnapshotNotFoundError(f"the transfer offers version {self.version}, not {version}")
    return dict(self.metadata)

  def load(self, version: int | None = None, target: PyTree | None = None,
           incarnation: str | None = None) -> tuple[PyTree, dict[str, Any]]:
    """Pulls the offer onto ``target``'s devices (tensor-parallel sub-mesh first), checks the
    incarnation and the checksums; raises like ``SnapshotReader.load``."""
    if version is not None and int(version) != self.version:
      raise SnapshotNotFoundError(f"the transfer offers version {self.version}, not {version}")
    found = self.metadata.get("incarnation")
    if incarnation is not None and found != incarnation:
      raise SnapshotNotFoundError(
          f"offered version {self.version} belongs to run incarnation {found!r}, not"
          f" {incarnation!r}")
    if target is None:
      raise ValueError("a transfer needs the server's restore target (shardings)")
    tp = int(self.offer["tensor_parallel"])
    leaves, treedef = jax.tree.flatten(target)
    mesh = leaves[0].sharding.mesh
    if mesh.shape.get("tensor", 1) != tp:
      raise ValueError(f"the learner staged version {self.version} for tensor_parallel={tp};"
                       f" this server runs {mesh.shape.get('tensor', 1)}: set the same"
                       " rollout.tensor_parallel on both")
    sub = list(mesh.devices.reshape(-1, tp)[0])
    offered = self.offer.get("dtypes") or []
    dtype = offered[0] if len(offered) == 1 else None  # the learner's write dtype
    pull_target = jax.tree.unflatten(treedef, [
        jax.ShapeDtypeStruct(t.shape, dtype or t.dtype,
                             sharding=_sub_mesh_sharding(t.sharding, sub)) for t in leaves])
    connection = self._local_server(self.host).connect(self.offer["address"])
    pulled = connection.pull(int(self.offer["uuid"]), pull_target)
    placed = place_verified(pulled, target, self.metadata,
                            f"version {self.version} pulled from {self.offer['address']}")
    return placed, dict(self.metadata)
