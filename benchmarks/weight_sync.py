"""Weight sync: seconds from "the learner has version v" to "a server decodes with v", per transport.

Usage::

  python benchmarks/weight_sync.py                           # 0.1B, 0.5B, 1.5B; 1 and 2 servers
  python benchmarks/weight_sync.py --shapes 0.5b --servers 1 --versions 4
  python benchmarks/weight_sync.py --small                   # CI smoke: a tiny model

DORA publishes a version every learner step and every server loads each one.
For each shape (random float32 master weights on a 4-device learner mesh,
FSDP x tensor; Qwen2.5-shaped: 0.1B is a 12-layer d768 model) and each
transport, this times, after one untimed warm cycle, ``--versions`` cycles of:

* **publish**: the learner's side, from its parameters to "servable"
  (``orbax``: ``SnapshotPublisher.publish`` of the float32 master weights,
  zstd-compressed, the default before issue 40; ``orbax_rollout_dtype``: the
  servers' bfloat16 written uncompressed (today's Orbax path); ``device``: ``TransportPublisher.publish`` into
  memory, its Orbax write off the path; ``transfer_server``: the same, plus
  ``TransferOffers.offer`` staging the version in the servers' layout and
  offering it on JAX's transfer server, once per server, as ``LoadVersion`` does);
* **load**: each server's restore / copy onto its own 2 devices in bfloat16,
  checksum verification included (a second server copies the first one's
  tree, as embedded servers share one read: ``SharedSnapshotLoader``; under
  ``transfer_server`` every server is a process of its own that pulls its offer
  over loopback, ``TransferSource``, the pod layout; the servers pull one after
  another, so "load" is their sum);
* **first decode**: one decode step of one slot on the new version;

and, measured alone on the same trees, the parts: device -> host copy,
checksum of the learner's tree, checksum of a server's tree. Sustained
versions/s = cycles / their total time. In the same run, the floors each
figure is a fraction of: this machine's memory-copy bandwidth (``np.copyto``
of 1 GiB) and disk write bandwidth (1 GiB written and ``fsync``-ed into the
snapshot directory's filesystem), so "publish at 0.4 of the disk floor" means
the bytes written would take 0.4x as long at raw disk speed; beside them, what
JAX itself moves between two devices (``jax.device_put`` of 1 GiB into a new
buffer), the floor of any in-memory transport built on JAX. Each (shape,
transport, servers) runs in its own process (``--one``), so one run's buffers
and caches never inflate the next's memory or times; freed host memory is handed
back to the OS after each cycle (``malloc_trim``), and servers compute in
bfloat16 (a float32-compute decode makes a float32 temporary of every weight,
which at 1.5B does not fit beside the rest on 24 GB). A case killed (out of
memory) is reported as such and the run goes on.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import dataclasses
import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import flax.linen as nn  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
import jax  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

from jax_dora.learner.mesh import LOGICAL_AXIS_RULES, make_mesh  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from jax_dora.model import CharTokenizer, ModelConfig, abstract_params, init_params, param_logical_specs  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from jax_dora.rollout.engine import DoraEngine, MultiVersionParams  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from jax_dora.snapshots import SnapshotPublisher, SnapshotReader, checksum  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from jax_dora.snapshots.memory import MemorySnapshots, TieredReader, TransportPublisher  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from jax_dora.snapshots.transfer import TransferOffers, TransferSource  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

GIB = 2 ** 30
TOK = CharTokenizer()
# Qwen2.5-shaped decoders (tied embeddings, GQA); the vocabulary is the character
# tokenizer's padded to Qwen's 151,936 rows except for the smallest shape.
SHAPES = {
    "tiny": dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=512),
    "0.1b": dict(d_model=768, n_layers=12, n_heads=12, n_kv_heads=4, d_ff=2048, vocab_size=32_000),
    "0.5b": dict(d_model=896, n_layers=24, n_heads=14, n_kv_heads=2, d_ff=4864,
                 vocab_size=151_936),
    "1.5b": dict(d_model=1536, n_layers=28, n_heads=12, n_kv_heads=2, d_ff=8960,
                 vocab_size=151_936),
}
TRANSPORTS = ("orbax", "orbax_rollout_dtype", "device", "transfer_server")


def memcpy_gib_s(size: int = GIB) -> float:
  a = np.ones(size // 4, np.float32)
  b = np.empty_like(a)
  best = min(_timed(lambda: np.copyto(b, a)) for _ in range(3))
  return size / best / GIB


def disk_write_gib_s(directory: str, size: int = GIB) -> float:
  data = np.random.default_rng(0).integers(0, 255, size, np.uint8).tobytes()
  path = os.path.join(directory, "floor.bin")

  def write():
    with open(path, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())

  best = min(_timed(write) for _ in range(2))
  os.remove(path)
  return size / best / GIB


def device_copy_gib_s(size: int = GIB) -> float:
  """``jax.device_put`` of ``size`` bytes from one device to another, into a new buffer."""
  src, dst = jax.devices()[0], jax.devices()[1] if len(jax.devices()) > 1 else jax.devices()[0]
  x = _block(jax.device_put(np.ones(size // 4, np.float32), src))
  best = min(_timed(lambda: _block(jax.device_put(x, dst))) for _ in range(3))
  del x
  return size / best / GIB


def _release_memory() -> None:
  """Frees what Python no longer references and hands freed heap pages back to the OS."""
  gc.collect()
  libc = ctypes.util.find_library("c")
  if libc:
    try:
      ctypes.CDLL(libc).malloc_trim(0)
    except AttributeError:  # not glibc
      pass


def _peak_rss_gib() -> float:
  """This process's peak resident memory (``VmHWM``), GiB; NaN where /proc has none."""
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("VmHWM:"):
          return int(line.split()[1]) * 1024 / GIB
  except OSError:
    pass
  return float("nan")


def _timed(fn) -> float:
  t0 = time.perf_counter()
  fn()
  return time.perf_counter() - t0


def _block(tree):
  jax.block_until_ready(jax.tree.leaves(tree))
  return tree


def learner_params(cfg: ModelConfig, seed: int):
  mesh = make_mesh(jax.devices()[:4], data=1, fsdp=2, tensor=2)
  with nn.logical_axis_rules(LOGICAL_AXIS_RULES):
    shardings = nn.logical_to_mesh_sharding(param_logical_specs(cfg), mesh, LOGICAL_AXIS_RULES)
  init = jax.jit(lambda key: init_params(cfg, key), out_shardings=shardings)
  return _block(init(jax.random.PRNGKey(seed)))


def first_decode(engine: DoraEngine, params, version: int) -> None:
  state = engine.init_decode_state()
  state, _, _ = engine.prefill_insert_batch_async(params, version, [TOK.encode_prompt("2+2=")],
                                                  [0], state)
  state, res = engine.generate(MultiVersionParams({version: params}, (version,)), state)
  res.convert_to_numpy()


def cycle(transport: str, publisher, reader, engines, params, version: int) -> dict[str, float]:
  """One version through ``transport``: publish, every server's load, a first decode."""
  out: dict[str, float] = {}
  t0 = time.perf_counter()
  publisher.publish(version, params, {"step": version})
  out["publish_s"] = time.perf_counter() - t0
  t1 = time.perf_counter()
  first = _block(engines[0].load_params(reader, version))
  out["load_first_s"] = time.perf_counter() - t1
  loaded = [first]
  for e in engines[1:]:
    loaded.append(_block(e.place_params(first)))
  out["load_all_s"] = time.perf_counter() - t1
  t2 = time.perf_counter()
  first_decode(engines[0], first, version)
  out["first_decode_s"] = time.perf_counter() - t2
  out["servable_s"] = out["publish_s"] + out["load_all_s"]
  out["to_first_decode_s"] = out["servable_s"] + out["first_decode_s"]
  del loaded, first
  _release_memory()
  return out


def timed_cycles(one_cycle, versions: int) -> dict[str, float]:
  """Version 1 untimed (compiles, the first Orbax save), then versions 2..versions+1: the
  median of each figure, sustained versions/s over them, and this process's peak memory."""
  one_cycle(1)
  t0 = time.perf_counter()
  rounds = [one_cycle(v) for v in range(2, 2 + versions)]
  total = time.perf_counter() - t0
  med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
  med["versions_per_s"] = versions / total
  med["peak_rss_gib"] = _peak_rss_gib()
  return med


def server_engine(cfg: ModelConfig, index: int) -> DoraEngine:
  """A one-slot bfloat16 server on 2 devices (tensor parallelism 2), the ``index``-th pair."""
  server_cfg = dataclasses.replace(cfg, param_dtype="bfloat16", dtype="bfloat16")
  return DoraEngine(server_cfg, TOK, num_slots=1, max_prefill_length=8, temperature=1.0,
                    devices=jax.devices()[4 + 2 * index: 6 + 2 * index], tensor_parallel=2)


def serve_pulls(shape: str) -> None:
  """A transfer-server puller process (``--serve``): one JSON offer per stdin line, one JSON
  line of timings back (pull + verify, first decode) per offer."""
  cfg = ModelConfig(max_seq_len=32, tie_embeddings=True, **SHAPES[shape])
  engine = server_engine(cfg, 0)
  print(json.dumps({"ready": True}), flush=True)
  for line in sys.stdin:
    msg = json.loads(line)
    t0 = time.perf_counter()
    first = _block(engine.load_params(TransferSource(msg["offer"], msg["version"]),
                                      msg["version"]))
    load_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    first_decode(engine, first, msg["version"])
    print(json.dumps({"load_s": load_s, "first_decode_s": time.perf_counter() - t1,
                      "peak_rss_gib": _peak_rss_gib()}), flush=True)
    del first
    _release_memory()


class _Pullers:
  """``n`` puller processes (``serve_pulls``), each a server with its own JAX runtime."""

  def __init__(self, shape: str, n: int):
    self.procs = [subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), f"--serve={shape}"], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True) for _ in range(n)]
    for p in self.procs:
      self._reply(p)

  @staticmethod
  def _reply(proc) -> dict:
    line = proc.stdout.readline()
    if not line:
      raise RuntimeError(f"a puller process ended (exit code {proc.wait()})")
    return json.loads(line)

  def pull(self, index: int, offer: dict, version: int) -> dict:
    proc = self.procs[index]
    proc.stdin.write(json.dumps({"offer": offer, "version": version}) + "\n")
    proc.stdin.flush()
    return self._reply(proc)

  def close(self) -> None:
    for p in self.procs:
      p.stdin.close()
      p.wait(timeout=60)


def transfer_cycle(publisher, offers, pullers: _Pullers, params, version: int
                   ) -> dict[str, float]:
  """One version through the transfer server: publish into memory (staged there once in the
  servers' layout), then per server an offer of it and its pull (in the server's process), one
  server after another."""
  out: dict[str, float] = {}
  t0 = time.perf_counter()
  publisher.publish(version, params, {"step": version})
  out["publish_s"] = time.perf_counter() - t0
  out["offer_s"] = out["load_all_s"] = 0.0
  for i in range(len(pullers.procs)):
    t1 = time.perf_counter()
    offer = offers.offer(version, tensor_parallel=2)
    out["offer_s"] += time.perf_counter() - t1
    got = pullers.pull(i, offer, version)
    out["load_all_s"] += time.perf_counter() - t1
    if i == 0:
      out["load_first_s"] = time.perf_counter() - t1
      out["first_decode_s"] = got["first_decode_s"]
    out["server_peak_rss_gib"] = max(out.get("server_peak_rss_gib", 0.0), got["peak_rss_gib"])
  out["pull_s"] = out["load_all_s"] - out["offer_s"]
  out["servable_s"] = out["publish_s"] + out["load_all_s"]
  out["to_first_decode_s"] = out["servable_s"] + out["first_decode_s"]
  _release_memory()
  return out


def run_transfer(shape: str, cfg: ModelConfig, params, n_servers: int, versions: int,
                 root: str) -> dict:
  directory = os.path.join(root, f"transfer_server-{n_servers}")
  shutil.rmtree(directory, ignore_errors=True)  # a case killed earlier leaves its versions
  disk = SnapshotPublisher(directory, max_to_keep=2, checksum_casts=("bfloat16",),
                           write_dtype="bfloat16")
  memory = MemorySnapshots(keep=1)
  offers = TransferOffers(memory, cfg, jax.devices()[:4], "127.0.0.1")
  # As the runtime does: staged once, at publish, into the servers' layout (tensor parallel 2).
  publisher = TransportPublisher(disk, memory, durable_every=0,
                                 serve_layout=lambda tree: offers.stage(tree, 2))
  pullers = _Pullers(shape, n_servers)
  try:
    return timed_cycles(lambda v: transfer_cycle(publisher, offers, pullers, params, v), versions)
  finally:
    pullers.close()
    publisher.close()
    shutil.rmtree(directory, ignore_errors=True)


def run_transport(transport: str, cfg: ModelConfig, params, n_servers: int, versions: int,
                  root: str) -> dict:
  directory = os.path.join(root, f"{transport}-{n_servers}")
  shutil.rmtree(directory, ignore_errors=True)  # a case killed earlier leaves its versions
  write = None if transport == "orbax" else "bfloat16"
  # "orbax" is the path before issue 40: float32 written, Orbax's zstd compression on.
  disk = SnapshotPublisher(directory, max_to_keep=2, checksum_casts=("bfloat16",),
                           write_dtype=write, compress=transport == "orbax")
  if transport == "device":
    publisher = TransportPublisher(disk, MemorySnapshots(keep=1), durable_every=0)
    reader = TieredReader(publisher.memory, SnapshotReader(directory))
  else:
    publisher, reader = disk, SnapshotReader(directory)
  engines = [server_engine(cfg, i) for i in range(n_servers)]
  med = timed_cycles(lambda v: cycle(transport, publisher, reader, engines, params, v), versions)
  publisher.wait_until_finished() if hasattr(publisher, "wait_until_finished") else None
  publisher.close()
  shutil.rmtree(directory, ignore_errors=True)
  del engines
  gc.collect()
  return med


def parts(cfg: ModelConfig, params) -> dict[str, float]:
  """The pieces every transport is made of, each timed alone on the same tree."""
  out = {}
  out["device_to_host_s"] = min(_timed(lambda: jax.device_get(params)) for _ in range(2))
  out["checksum_learner_s"] = min(_timed(lambda: checksum.record(params)) for _ in range(2))
  cast = _block(jax.jit(lambda t: jax.tree.map(lambda x: x.astype("bfloat16"), t))(params))
  out["checksum_bf16_s"] = min(_timed(lambda: checksum.checksums(cast)) for _ in range(2))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[4:6]).reshape(1, 2), ("slots", "tensor"))
  target = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  out["device_copy_bf16_s"] = min(
      _timed(lambda: _block(jax.device_put(cast, target))) for _ in range(2))
  del cast
  return out


def one(spec: str, versions: int, root: str) -> dict:
  """``SHAPE:TRANSPORT:SERVERS`` (or ``SHAPE:parts``) in this process."""
  shape, transport, *rest = spec.split(":")
  cfg = ModelConfig(max_seq_len=32, tie_embeddings=True, **SHAPES[shape])
  params = learner_params(cfg, 0)
  if transport == "parts":
    return {"params": sum(x.size for x in jax.tree.leaves(params)), **parts(cfg, params)}
  if transport == "transfer_server":
    return run_transfer(shape, cfg, params, int(rest[0]), versions, root)
  return run_transport(transport, cfg, params, int(rest[0]), versions, root)


def _in_subprocess(spec: str, versions: int, root: str) -> dict:
  proc = subprocess.run(
      [sys.executable, os.path.abspath(__file__), f"--one={spec}", f"--versions={versions}",
       f"--dir={root}"], capture_output=True, text=True, check=False)
  if proc.returncode in (-9, 137):
    return {"failed": "killed (SIGKILL: out of memory on this machine)"}
  if proc.returncode != 0:
    raise RuntimeError(f"{spec} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--shapes", default="0.1b,0.5b,1.5b")
  p.add_argument("--transports", default=",".join(TRANSPORTS))
  p.add_argument("--servers", default="1,2")
  p.add_argument("--versions", type=int, default=3)
  p.add_argument("--dir", default="", help="where snapshots are written (default: a temp dir)")
  p.add_argument("--small", action="store_true", help="CI smoke: the tiny shape, 1 version")
  p.add_argument("--no_parts", action="store_true",
                 help="skip the parts (their host copy of the float32 tree does not fit 1.5B on 24 GB)")
  p.add_argument("--one", default="", help=argparse.SUPPRESS)  # SHAPE:TRANSPORT:SERVERS, JSON out
  p.add_argument("--serve", default="", help=argparse.SUPPRESS)  # SHAPE: a transfer puller
  p.add_argument("--json", default="")
  a = p.parse_args(argv)
  if a.serve:  # before the snapshot directory: a puller writes none
    serve_pulls(a.serve)
    return {}
  root = a.dir or tempfile.mkdtemp(prefix="weight_sync_")
  os.makedirs(root, exist_ok=True)
  if a.one:
    print(json.dumps(one(a.one, a.versions, root)))
    return {}
  shapes = ["tiny"] if a.small else a.shapes.split(",")
  versions = 1 if a.small else a.versions
  floor_size = 64 * 2 ** 20 if a.small else GIB
  out: dict = {"machine": f"{os.cpu_count()} CPU cores, jax {jax.__version__}",
               "memcpy_gib_s": memcpy_gib_s(floor_size),
               "disk_write_gib_s": disk_write_gib_s(root, floor_size),
               "device_copy_gib_s": device_copy_gib_s(floor_size), "shapes": {}}
  print(f"floors: memory copy {out['memcpy_gib_s']:.2f} GiB/s, disk write (fsync)"
        f" {out['disk_write_gib_s']:.2f} GiB/s, jax.device_put between devices"
        f" {out['device_copy_gib_s']:.2f} GiB/s; {out['machine']}", flush=True)
  for shape in shapes:
    if a.no_parts:
      cfg = ModelConfig(max_seq_len=32, tie_embeddings=True, **SHAPES[shape])
      pr = {"params": sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_params(cfg)))}
    else:
      pr = _in_subprocess(f"{shape}:parts", versions, root)
    n = pr.pop("params")
    res = {"params": n, "float32_gib": 4 * n / GIB, "parts": pr, "runs": {}}
    for transport in a.transports.split(","):
      for servers in (int(s) for s in a.servers.split(",")):
        r = _in_subprocess(f"{shape}:{transport}:{servers}", versions, root)
        res["runs"][f"{transport}/{servers}"] = r
        if "failed" in r:
          print(f"{shape} {transport} {servers} server(s): {r['failed']}", flush=True)
          continue
        written = 4 * n if transport == "orbax" else 2 * n
        r["publish_x_disk_floor"] = r["publish_s"] / (written / GIB / out["disk_write_gib_s"])
        # The bfloat16 bytes a version must at least move: the learner-side cast copy plus
        # one copy per server, at memory-copy speed.
        moved = 2 * n * (1 + servers)
        r["servable_x_memcpy_floor"] = r["servable_s"] / (moved / GIB / out["memcpy_gib_s"])
        r["servable_x_device_copy_floor"] = r["servable_s"] / (
            moved / GIB / out["device_copy_gib_s"])
        print(f"{shape} ({n / 1e9:.2f}B params) {transport:<20} {servers} server(s):"
              f" publish {r['publish_s']:.2f}s, load {r['load_all_s']:.2f}s, first decode"
              f" {r['first_decode_s']:.2f}s -> {r['to_first_decode_s']:.2f}s;"
              f" {r['versions_per_s']:.2f} versions/s", flush=True)
    out["shapes"][shape] = res
  _table(out)
  if a.json:
    with open(a.json, "w") as f:
      json.dump(out, f, indent=2)
  if not a.dir:
    shutil.rmtree(root, ignore_errors=True)
  return out


def _table(out: dict) -> None:
  print("| shape | transport | servers | publish | load (all servers) | first decode | learner"
        " step end -> first decode | x today's orbax | publish / disk floor | servable / memcpy"
        " floor | servable / device_put floor | versions/s |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|")
  for shape, res in out["shapes"].items():
    for key, r in res["runs"].items():
      transport, servers = key.split("/")
      if "failed" in r:
        print(f"| {shape} ({res['params'] / 1e9:.2f}B) | {transport} | {servers} | {r['failed']} |")
        continue
      base = res["runs"].get(f"orbax/{servers}", {}).get("to_first_decode_s", float("nan"))
      print(f"| {shape} ({res['params'] / 1e9:.2f}B) | {transport} | {servers} |"
            f" {r['publish_s']:.2f} s | {r['load_all_s']:.2f} s | {r['first_decode_s']:.2f} s |"
            f" {r['to_first_decode_s']:.2f} s | {base / r['to_first_decode_s']:.1f}x faster |"
            f" {r['publish_x_disk_floor']:.1f}x | {r['servable_x_memcpy_floor']:.1f}x |"
            f" {r['servable_x_device_copy_floor']:.1f}x |"
            f" {r['versions_per_s']:.2f} |")
  for shape, res in out["shapes"].items():
    pr = res["parts"]
    if not pr:
      continue
    print(f"parts, {shape}: device->host {pr['device_to_host_s']:.2f} s, checksum of the learner's"
          f" float32 tree {pr['checksum_learner_s']:.2f} s, of a bfloat16 tree"
          f" {pr['checksum_bf16_s']:.2f} s, bfloat16 device copy to a server"
          f" {pr['device_copy_bf16_s']:.2f} s")


if __name__ == "__main__":
  main()
