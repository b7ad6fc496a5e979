"""Standalone rollout server: ``python -m jax_dora.rollout.server_main``.

Runs one :class:`RolloutDriver` on this host's local devices behind the gRPC
service of :mod:`jax_dora.rollout.server`, loading policy snapshots from
``config.snapshots.directory`` (the learner publishes there). On a TPU pod
every worker of the rollout slice runs one of these (see
``launchers/launch_rollout.sh``) and the learner connects to all of them via
``config.rollout.server_addresses``.

Example::

  python -m jax_dora.rollout.server_main --config=configs/tiny.py \\
      --config.rollout.port=9123 --config.snapshots.directory=/tmp/snaps

The newest snapshot present at start-up is loaded before the port opens to
``Health`` with a non-empty version list, so a launcher can wait for
readiness; later versions arrive through ``LoadVersion`` calls from the
orchestrator. SIGTERM/SIGINT stop the server gracefully (in-flight streams
get ``--grace_s`` seconds, then fail with UNAVAILABLE on the client, which
re-issues them).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

from absl import app
from absl import flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Run config file, e.g. configs/tiny.py.", lock_config=True
)
_HOST = flags.DEFINE_string(
    "host",
    "0.0.0.0",
    "Interface to bind; 0.0.0.0 so learner hosts can reach the server, "
    "127.0.0.1 for tests.",
)
_GRACE_S = flags.DEFINE_float(
    "grace_s", 5.0, "Seconds in-flight streams get to finish on SIGTERM."
)
_NAME = flags.DEFINE_string(
    "name", "", "Server name in logs/Health (default rollout-<host>-<port>)."
)

_log = logging.getLogger("jax_dora.rollout.server_main")


def _snapshot_dir(config) -> str:
  return config.snapshots.directory or os.path.join(
      config.output_dir, "snapshots"
  )


def _init_distributed(config) -> None:
  """Joins the multi-host JAX runtime when the config asks for it.

  On a multi-host TPU slice the runtime only comes up once every worker has
  called ``jax.distributed.initialize``; each worker then serves on its
  *local* devices only (no cross-host collectives in decoding), which is why
  every worker runs its own server.
  """
  import jax  # pylint: disable=g-import-not-at-top

  from jax_dora.distributed import maybe_initialize_distributed  # pylint: disable=g-import-not-at-top

  if not maybe_initialize_distributed(config):
    return
  d = config.distributed
  n = d.num_learner_processes
  if 0 < n and jax.process_index() < n:
    raise app.UsageError(
        f"process {jax.process_index()} is a learner process"
        f" (config.distributed.num_learner_processes={n}); rollout servers take"
        " process ids >= that"
    )


def build_driver(config, snapshot_dir: str, name: str):
  """Engine + driver on this host's first ``devices_per_server`` local devices."""
  import jax  # pylint: disable=g-import-not-at-top

  from jax_dora.rollout import driver as driver_lib  # pylint: disable=g-import-not-at-top
  from jax_dora.rollout import engine as engine_lib  # pylint: disable=g-import-not-at-top

  devices = jax.local_devices()
  n = config.rollout.devices_per_server
  if n > 0:
    if n > len(devices):
      raise ValueError(
          f"config.rollout.devices_per_server={n} but this host has only"
          f" {len(devices)} local devices"
      )
    devices = devices[:n]
  engine = engine_lib.build_engine(config, devices)
  from jax_dora.config import RunConfig  # pylint: disable=g-import-not-at-top

  config = RunConfig.of(config)
  return driver_lib.RolloutDriver(
      engine,
      snapshot_dir,
      max_versions=config.rollout.max_versions,
      name=name,
      precompile=config.precompile,
      hold_timeout_s=config.rollout.hold_timeout_s,
      held_kv_slots=config.held_kv_rows,
  ), devices


_START_LOAD_ATTEMPTS = 5


def load_newest_at_start(driver, reader, name: str) -> int | None:
  """Loads the newest published snapshot, if any; returns its version.

  Best effort, because the learner pushes every version it wants served
  through ``LoadVersion`` anyway: a server restarted mid-run must come up and
  serve rather than die. A version retired between listing and loading (a
  fast learner with a small ``max_to_keep`` publishes several a second) is
  retried with the new newest one; any other failure (unreadable, wrong
  checksums) is logged and the server waits for ``LoadVersion``.
  """
  from jax_dora.snapshots import SnapshotNotFoundError  # pylint: disable=g-import-not-at-top

  for _ in range(_START_LOAD_ATTEMPTS):
    try:
      latest = reader.latest_version()
    except Exception as e:  # pylint: disable=broad-except
      _log.warning("%s: cannot list snapshots in %s: %s", name, reader.directory, e)
      return None
    if latest is None:
      _log.info("%s: no snapshot yet; waiting for LoadVersion", name)
      return None
    try:
      driver.load_version(latest)
      return latest
    except SnapshotNotFoundError as e:
      _log.info("%s: snapshot %d retired while loading it (%s); trying the newest again", name,
                latest, e)
    except Exception as e:  # pylint: disable=broad-except
      _log.warning("%s: cannot load snapshot %d at start-up (%s: %s); waiting for LoadVersion",
                   name, latest, type(e).__name__, e)
      return None
  _log.warning("%s: snapshots kept being retired while loading (%d attempts); waiting for"
               " LoadVersion", name, _START_LOAD_ATTEMPTS)
  return None


async def _serve(config, host: str, grace_s: float, name: str) -> None:
  from jax_dora.rollout import server as server_lib  # pylint: disable=g-import-not-at-top
  from jax_dora.snapshots import SnapshotReader  # pylint: disable=g-import-not-at-top

  snapshot_dir = _snapshot_dir(config)
  driver, devices = build_driver(config, snapshot_dir, name)
  _log.info(
      "%s: driver on %d device(s) [%s], %d slots, snapshots in %s",
      name,
      len(devices),
      ", ".join(str(d) for d in devices),
      config.rollout.slots,
      snapshot_dir,
  )
  await asyncio.to_thread(load_newest_at_start, driver, SnapshotReader(snapshot_dir), name)

  server = server_lib.RolloutServer(
      driver, config.rollout.port, host=host, name=name,
      transfer_host=config.snapshots.transfer_host,
  )
  await server.start()
  status = driver.status()
  _log.info(
      "%s: serving on %s, versions loaded %s",
      name,
      server.address,
      list(status.versions_loaded),
  )

  loop = asyncio.get_running_loop()
  stopping = asyncio.Event()
  for sig in (signal.SIGTERM, signal.SIGINT):
    loop.add_signal_handler(sig, stopping.set)
  await stopping.wait()
  _log.info("%s: signal received; stopping (grace %.1fs)", name, grace_s)
  # Refuse new calls first, then stop the driver, which ends every in-flight
  # stream with a RolloutError naming its request (clients re-issue it
  # elsewhere); ``grace_s`` lets those final frames reach the clients.
  stopped = asyncio.ensure_future(server.stop(grace_s))
  await asyncio.to_thread(driver.stop)
  await stopped
  _log.info("%s: stopped", name)


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  from jax_dora import config as config_lib  # pylint: disable=g-import-not-at-top

  config = _CONFIG.value
  if config is None:
    raise app.UsageError("--config is required, e.g. --config=configs/tiny.py")
  if config.role == "learner":
    raise app.UsageError("config.role=learner is the training process (jax_dora.train);"
                         " a rollout server takes role=rollout (or the default all)")
  # A server has no server addresses of its own: validate it as a rollout process.
  config.role = "rollout"
  config_lib.validate(config)
  logging.basicConfig(
      level=logging.INFO,
      stream=sys.stderr,
      format="%(asctime)s %(levelname)s %(name)s: %(message)s",
      force=True,
  )
  # Orbax logs several INFO lines per restore through absl; keep ours readable.
  logging.getLogger("absl").setLevel(logging.WARNING)
  from jax_dora.compile_cache import setup_compile_cache  # pylint: disable=g-import-not-at-top

  # Before the first compile: a restarted server loads its prefill and
  # decode programs from disk.
  setup_compile_cache(config.compile_cache_dir)
  _init_distributed(config)
  name = _NAME.value or f"rollout-{os.uname().nodename}-{config.rollout.port}"
  asyncio.run(_serve(config, _HOST.value, _GRACE_S.value, name))


def run() -> None:
  """Console-script entry point (``jax-dora-rollout-server``)."""
  app.run(main)


if __name__ == "__main__":
  run()
