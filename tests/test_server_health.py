"""Server liveness without request deadlines: health checks, failover, re-admission.

Real components only: a rollout server *process* (``server_main`` on the tiny
model, so it can be SIGSTOPped and SIGKILLed), real in-process
``RolloutServer`` + ``RolloutDriver`` pairs on one shared tiny engine (cheap to
start and restart at a given port), real gRPC on loopback and the real
:class:`Dispatcher`. Thresholds are shrunk to about a second so that a
SIGSTOPped server is declared down quickly.

What must hold (issue 12): a generation is never failed for taking long; a
server that stops answering has its in-flight requests re-issued elsewhere
(each key exactly once) and is re-admitted when it answers again; a server
restarted at the same address is re-admitted only after loading the current
version, and retired for good once it has restarted more than
``max_restarts`` times; with every server down, requests wait for one instead
of failing, and fail loudly once no server can come back.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import asyncio
import pathlib
import signal
import threading
import time

import jax
import numpy as np
import pytest
from _harness import RolloutServerProcess, free_port

from jax_dora import config as config_lib
from jax_dora.model import CharTokenizer
from jax_dora.model import ModelConfig
from jax_dora.model import init_params
from jax_dora.orchestrator.dispatch import Dispatcher
from jax_dora.orchestrator.dispatch import NoLiveServersError
from jax_dora.rollout import api
from jax_dora.rollout.client import GrpcRolloutClient
from jax_dora.rollout.driver import RolloutDriver
from jax_dora.rollout.embedded import EmbeddedRolloutClient
from jax_dora.rollout.engine import build_engine
from jax_dora.rollout.server import RolloutServer
from jax_dora.snapshots import SnapshotPublisher
from jax_dora.types import Prompt

pytestmark = pytest.mark.timeout(120)

_VERSION = 3
_V2 = 4  # published mid-test, while a server is down
_SLOTS = 2
_MAX_NEW = 16
_OVERRIDES = dict(d_model=32, n_layers=1, n_heads=2, d_ff=64)
_TOK = CharTokenizer()
# Monitor settings scaled down from seconds-to-minutes to about a second.
_FAST = dict(
    health_interval_s=0.2,
    health_timeout_s=0.5,
    unhealthy_after_s=1.5,
    stall_timeout_s=0,
    retry_backoff_s=0.05,
    readmit_backoff_max_s=0.5,
)


def _run_config():
  c = config_lib.base_config()
  c.model.update(_OVERRIDES)
  c.rollout.slots = _SLOTS
  return c


def _prompt(i: int) -> Prompt:
  return Prompt(sample_id=i, task="arith", text=f"{i}+{i}=", answer=str(2 * i))


def _tokens(p: Prompt) -> np.ndarray:
  return np.concatenate([[_TOK.bos_id], _TOK.encode_ids(p.text)]).astype(np.int32)


def _state(d: Dispatcher, client) -> dict:
  return next(s for s in d.server_states() if s["name"] == client.name)


async def _until(pred, timeout_s: float = 20.0, what: str = "condition"):
  deadline = time.monotonic() + timeout_s
  while not pred():
    assert time.monotonic() < deadline, f"timed out waiting for {what}"
    await asyncio.sleep(0.05)


async def _run_all(d: Dispatcher, ids) -> list[api.RolloutResult]:
  ps = [_prompt(i) for i in ids]
  return await asyncio.wait_for(
      asyncio.gather(*(d.run(p, _tokens(p), 0, _MAX_NEW) for p in ps)), 60
  )


def _check_complete(results, version: int) -> None:
  for r in results:
    assert r.finish_reason in ("eos", "length"), r
    n = len(r.completion_tokens)
    assert n >= 1 and len(r.logprobs) == n
    assert {s.version for s in r.spans} == {version}


# ------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def params():
  cfg = ModelConfig.from_config_dict(_run_config().model, vocab_size=_TOK.vocab_size)
  return init_params(cfg, jax.random.PRNGKey(0))


@pytest.fixture(scope="module")
def snapshot_dir(tmp_path_factory, params) -> pathlib.Path:
  d = tmp_path_factory.mktemp("snaps")
  with SnapshotPublisher(d) as pub:
    pub.publish(_VERSION, params, {"learner_step": _VERSION})
  return d


@pytest.fixture(scope="module")
def launched(snapshot_dir, tmp_path_factory):
  """The server process, started first so that its start-up overlaps the engine's."""
  p = RolloutServerProcess(snapshot_dir, tmp_path_factory.mktemp("proc") / "server.log",
                           slots=_SLOTS, model_overrides=_OVERRIDES)
  try:
    yield p
  finally:
    p.close()


@pytest.fixture(scope="module")
def engine(snapshot_dir):
  """One tiny engine for every in-process server, compiled once here."""
  eng = build_engine(_run_config(), jax.devices()[:1])
  drv = RolloutDriver(eng, str(snapshot_dir), max_versions=3, name="warmup")
  try:
    drv.load_version(_VERSION)
    done = threading.Event()
    drv.submit(api.RolloutRequest("warm", _tokens(_prompt(1)), _MAX_NEW),
               lambda item: done.set() if not isinstance(item, api.RolloutChunk) else None)
    assert done.wait(120)
  finally:
    drv.stop()
  return eng


@pytest.fixture(scope="module")
def proc(launched, engine):
  launched.wait_ready()
  return launched


class _InProc:
  """A real RolloutServer + RolloutDriver in this process, on the shared engine."""

  def __init__(self, engine, snapshot_dir, name: str, port: int = 0, driver=None):
    self.driver = driver or RolloutDriver(engine, str(snapshot_dir), max_versions=3, name=name)
    self.server = RolloutServer(self.driver, port, host="127.0.0.1", name=name)

  @property
  def address(self) -> str:
    return self.server.address

  @property
  def port(self) -> int:
    return self.server.port

  async def start(self) -> _InProc:
    for _ in range(50):  # the port of a server just stopped may take a moment
      try:
        await self.server.start()
        return self
      except (OSError, RuntimeError):
        await asyncio.sleep(0.1)
    raise AssertionError("could not bind the in-process server")

  async def stop(self) -> None:
    await self.server.stop(0)


# --------------------------------------------------------------------- tests
async def test_generation_has_no_deadline_but_control_calls_do(proc):
  """A request outlasting the client's timeout_s is not failed for it."""
  client = GrpcRolloutClient(proc.address, timeout_s=0.3)
  try:
    await client.health()  # connected
    proc.signal(signal.SIGSTOP)
    try:
      t0 = time.monotonic()
      gen = asyncio.ensure_future(
          client.generate(api.RolloutRequest("slow", _tokens(_prompt(7)), _MAX_NEW)))
      # Control RPCs keep a short deadline (the monitor relies on that).
      with pytest.raises(api.RolloutError, match="DEADLINE_EXCEEDED"):
        await client.status()
      await asyncio.sleep(1.0)
      assert not gen.done()
    finally:
      proc.signal(signal.SIGCONT)
    res = await asyncio.wait_for(gen, 60)
    assert time.monotonic() - t0 > 1.0 > client.timeout_s
    _check_complete([res], _VERSION)
  finally:
    await client.close()


async def test_sigstopped_server_is_taken_down_and_readmitted(proc, engine, snapshot_dir):
  """In-flight requests of a hung server move on after the health threshold;
  the same process answering again is re-admitted without using the restart budget."""
  b = await _InProc(engine, snapshot_dir, "b").start()
  ca = GrpcRolloutClient(proc.address, timeout_s=5)
  cb = GrpcRolloutClient(b.address, timeout_s=5)
  reissued = []
  d = Dispatcher([ca, cb], on_reissue=lambda sid, m, why: reissued.append((sid, m)),
                 max_restarts=0, **_FAST)
  stopped = False
  try:
    await d.broadcast_version(_VERSION)
    await _until(lambda: all(s["instance"] for s in d.server_states()), what="instances")
    proc.signal(signal.SIGSTOP)
    stopped = True
    t0 = time.monotonic()
    ids = range(100, 106)
    results = await _run_all(d, ids)  # routed least-loaded: half of them to the stopped one
    elapsed = time.monotonic() - t0
    _check_complete(results, _VERSION)
    # The stopped server's requests were re-issued, each exactly once.
    assert reissued and len(reissued) == len(set(reissued))
    assert set(reissued) <= {(i, 0) for i in ids}
    # They hung until the server was declared down (not failed at once, not
    # by a deadline), then completed elsewhere.
    assert 1.0 <= elapsed < _FAST["unhealthy_after_s"] + 8, elapsed
    assert _state(d, ca)["state"] == "down" and d.live_clients == [cb]

    proc.signal(signal.SIGCONT)
    stopped = False
    await _until(lambda: ca in d.live_clients, what="re-admission")
    st = _state(d, ca)
    assert st["restarts"] == 0 and st["blips"] == 1  # same process: no budget used
    # The woken server dropped the streams the dispatcher had cancelled (no
    # slot decodes for nobody, no second result can exist) and serves again.
    st = await ca.status()
    assert st.active_slots == 0 and st.queued_requests == 0, st
    before = st.generated_tokens
    _check_complete(await _run_all(d, range(110, 114)), _VERSION)
    assert (await ca.status()).generated_tokens > before
  finally:
    if stopped:
      proc.signal(signal.SIGCONT)
    await d.close()
    await asyncio.gather(ca.close(), cb.close())
    await b.stop()
    b.driver.stop()


async def test_a_group_stays_on_one_server_while_it_has_room(proc, engine, snapshot_dir):
  """A GRPO group's members go to the server its first member went to (so the shared
  prompt is prefilled once, there) while that server has a free slot; past its slots a
  member falls back to the least-loaded server, and both are counted (issue 39 item 4)."""
  b = await _InProc(engine, snapshot_dir, "affinity-b").start()
  ca = GrpcRolloutClient(proc.address, timeout_s=5)
  cb = GrpcRolloutClient(b.address, timeout_s=5)
  d = Dispatcher([ca, cb], **_FAST)
  kept, fell_back = "dispatch/group_affinity_kept_total", "dispatch/group_affinity_fallbacks_total"
  try:
    await d.broadcast_version(_VERSION)
    await _until(lambda: all(s["total_slots"] == _SLOTS for s in d.server_states()),
                 what="both servers' slot counts")

    async def group(p: Prompt, members: int) -> list[str]:
      res = await asyncio.wait_for(
          asyncio.gather(*(d.run(p, _tokens(p), m, _MAX_NEW) for m in range(members))), 60)
      _check_complete(res, _VERSION)
      return [r.server for r in res]

    # Two groups of _SLOTS members at once: least-loaded routing alone alternates the
    # servers member by member (a, b, a, b), splitting both groups.
    s0, s1 = await asyncio.gather(group(_prompt(500), _SLOTS), group(_prompt(501), _SLOTS))
    assert len(set(s0)) == 1 and len(set(s1)) == 1 and s0[0] != s1[0], (s0, s1)
    assert d.group_affinity_counts() == {kept: 2, fell_back: 0}
    # One member more than a server has slots: the last one goes to the other server.
    s2 = await group(_prompt(502), _SLOTS + 1)
    assert s2[0] == s2[1] != s2[2], s2
    assert d.group_affinity_counts() == {kept: 3, fell_back: 1}
  finally:
    await d.close()
    await asyncio.gather(ca.close(), cb.close())
    await b.stop()
    b.driver.stop()


async def test_killed_server_restarted_at_same_address(proc, engine, snapshot_dir, params):
  """SIGKILL, restart at the same port: re-admitted after loading the current
  version and counted as a restart; one restart more than max_restarts retires it."""
  b = await _InProc(engine, snapshot_dir, "b").start()
  ca = GrpcRolloutClient(proc.address, timeout_s=5)
  cb = GrpcRolloutClient(b.address, timeout_s=5)
  d = Dispatcher([ca, cb], max_restarts=1, **_FAST)
  restarted = []
  try:
    await d.broadcast_version(_VERSION)
    await _until(lambda: all(s["instance"] for s in d.server_states()), what="instances")
    proc.signal(signal.SIGKILL)
    proc.proc.wait(10)
    # Requests keep completing (those that hit the dead server are re-issued).
    _check_complete(await _run_all(d, range(200, 204)), _VERSION)
    await _until(lambda: _state(d, ca)["state"] == "down", what="down")
    assert d.live_clients == [cb]

    # The run moves on while the server is away.
    def publish():
      with SnapshotPublisher(snapshot_dir) as pub:
        pub.publish(_V2, params, {"learner_step": _V2})

    await asyncio.to_thread(publish)  # off the loop: the monitors keep probing
    await d.broadcast_version(_V2)
    assert b.driver.status().newest_version == _V2

    # Restarted at the same address: a new server with nothing loaded.
    a1 = await _InProc(engine, snapshot_dir, "a-restarted", port=proc.port).start()
    restarted.append(a1)
    assert a1.driver.status().versions_loaded == ()
    await _until(lambda: ca in d.live_clients, what="re-admission")
    # Admitted only after loading the newest broadcast version.
    assert a1.driver.status().versions_loaded == (_V2,)
    st = _state(d, ca)
    assert st["restarts"] == 1 and st["instance"] == a1.server.instance
    before = a1.driver.status().generated_tokens
    _check_complete(await _run_all(d, range(210, 214)), _V2)
    assert a1.driver.status().generated_tokens > before

    # A second restart exceeds max_restarts=1: retired for good, though it answers.
    await a1.stop()
    a2 = await _InProc(engine, snapshot_dir, "a-again", port=proc.port, driver=a1.driver).start()
    restarted.append(a2)
    await _until(lambda: _state(d, ca)["state"] == "retired", what="retirement")
    assert _state(d, ca)["restarts"] == 2
    await asyncio.sleep(1.0)
    assert d.live_clients == [cb]
    _check_complete(await _run_all(d, range(220, 222)), _V2)
  finally:
    await d.close()
    await asyncio.gather(ca.close(), cb.close())
    for s in [b] + restarted:
      await s.stop()
      s.driver.stop()


async def test_all_servers_down_waits_then_raises_when_none_can_return(engine, snapshot_dir):
  """No admitted server: requests wait for one (not NoLiveServersError) and
  succeed when it returns; they fail loudly once its budget is spent, or
  after no_server_grace_s when nothing comes back (abort_all still ends them)."""
  s1 = await _InProc(engine, snapshot_dir, "only").start()
  clients = [GrpcRolloutClient(s1.address, timeout_s=5) for _ in range(2)]
  clients.append(GrpcRolloutClient(f"127.0.0.1:{free_port()}", timeout_s=1))  # nobody there
  d = Dispatcher([clients[0]], max_restarts=1, **_FAST)
  d0 = Dispatcher([clients[1]], max_restarts=0, **_FAST)
  dg = Dispatcher([clients[2]], no_server_grace_s=2.0, **_FAST)
  s2 = None
  try:
    for x in (d, d0):
      await x.broadcast_version(_VERSION)
    await _until(lambda: all(x.server_states()[0]["instance"] for x in (d, d0)))
    await s1.stop()  # the only server is gone (connections refused)
    p, p0 = _prompt(300), _prompt(301)
    t = asyncio.ensure_future(d.run(p, _tokens(p), 0, _MAX_NEW))
    t0 = asyncio.ensure_future(d0.run(p0, _tokens(p0), 0, _MAX_NEW))
    await asyncio.sleep(_FAST["unhealthy_after_s"] + 1.0)
    assert not t.done() and not t0.done()  # waiting, not failed
    assert d.server_states()[0]["state"] == "down" and not d.live_clients

    s2 = await _InProc(engine, snapshot_dir, "only-again", port=s1.port, driver=s1.driver).start()
    _check_complete([await asyncio.wait_for(t, 30)], _VERSION)
    assert d.server_states()[0]["restarts"] == 1 and d.live_clients
    with pytest.raises(NoLiveServersError, match="all rollout servers have failed"):
      await asyncio.wait_for(t0, 30)  # max_restarts=0: that restart retired it
    assert d0.server_states()[0]["state"] == "retired"

    # Nothing ever answers: broadcast does not raise; a waiting request
    # can still be aborted (as if queued on a server) ...
    await dg.broadcast_version(_VERSION)
    start = time.monotonic()
    waiting = asyncio.ensure_future(dg.run(p, _tokens(p), 0, _MAX_NEW))
    await asyncio.sleep(0.2)
    assert not waiting.done()
    await dg.abort_all()
    r = await asyncio.wait_for(waiting, 5)
    assert r.finish_reason == "aborted" and len(r.completion_tokens) == 0
    # ... and run gives up once no server has been admitted for the grace.
    with pytest.raises(NoLiveServersError, match="came back within"):
      await dg.run(p, _tokens(p), 0, _MAX_NEW)
    assert time.monotonic() - start < 10
  finally:
    for x in (d, d0, dg):
      await x.close()
    await asyncio.gather(*(c.close() for c in clients))
    if s2 is not None:
      await s2.stop()
    s1.driver.stop()


async def test_stalled_server_and_stopped_embedded_driver(engine, snapshot_dir):
  """A server that answers Health but generates nothing for stall_timeout_s
  is taken down, its request re-issued, and the stall counts as a restart;
  an embedded driver that stopped cannot come back and is retired at its
  first failed health check."""
  # "stuck" has no version loaded (nothing was broadcast): it queues forever.
  stuck = RolloutDriver(engine, str(snapshot_dir), max_versions=3, name="stuck")
  good = RolloutDriver(engine, str(snapshot_dir), max_versions=3, name="good")
  good.load_version(_VERSION)
  reissued = []
  d = Dispatcher(
      [EmbeddedRolloutClient(stuck), EmbeddedRolloutClient(good)],
      on_reissue=lambda sid, m, why: reissued.append((sid, m)),
      max_restarts=0, **dict(_FAST, stall_timeout_s=1.0),
  )
  try:
    results = await _run_all(d, [400, 401])
    _check_complete(results, _VERSION)
    assert len(reissued) == 1
    st = d.server_states()[0]
    assert st["state"] == "retired" and "no token generated" in st["why"], st
    assert st["restarts"] == 1  # the stall used the (empty) restart budget
    # A stopped embedded driver fails its health check: retired, not awaited.
    good.stop()
    with pytest.raises(NoLiveServersError, match="all rollout servers have failed"):
      await asyncio.wait_for(_run_all(d, [402]), 10)
    assert [s["state"] for s in d.server_states()] == ["retired", "retired"]
  finally:
    await d.close()
    stuck.stop()
    good.stop()


def test_results_aborted_before_reaching_a_server_carry_the_run_incarnation():
  """They used to carry none: the orchestrator took them for another run's
  results, logged an error and re-issued the sample (176 times at the end of
  one staleness-sweep run)."""
  d = Dispatcher([object()], incarnation="run-abc")
  assert d._aborted("r-1", None).incarnation == "run-abc"  # pylint: disable=protected-access


def test_a_restarted_server_comes_up_whatever_happens_to_the_newest_snapshot(
    engine, params, tmp_path):
  """Start-up loads the newest snapshot best-effort: one retired between listing and
  loading (a fast learner with a small max_to_keep: this killed a restarted server in the
  chaos run, leaving it one server short for its last event) is retried with the new
  newest; an unreadable one leaves the server waiting for LoadVersion, not dead."""
  from jax_dora.rollout.server_main import load_newest_at_start  # pylint: disable=g-import-not-at-top
  from jax_dora.snapshots import SnapshotReader  # pylint: disable=g-import-not-at-top

  with SnapshotPublisher(tmp_path, max_to_keep=2) as pub:
    for v in (1, 2, 3):
      pub.publish(v, params, {"learner_step": v})
  reader = SnapshotReader(tmp_path)
  listed = iter([1, 3])  # what a listing just before version 1's retirement returned, then now
  reader.latest_version = lambda: next(listed)
  driver = RolloutDriver(engine, str(tmp_path), max_versions=3, name="restarted")
  try:
    assert load_newest_at_start(driver, reader, "restarted") == 3
    assert list(driver.status().versions_loaded) == [3]
  finally:
    driver.stop()

  for f in (tmp_path / "3").rglob("*"):
    if f.is_file() and "params" in str(f.relative_to(tmp_path / "3")):
      f.write_bytes(b"not a tensorstore chunk")
  driver = RolloutDriver(engine, str(tmp_path), max_versions=3, name="restarted")
  try:
    assert load_newest_at_start(driver, SnapshotReader(tmp_path), "restarted") is None
    driver.load_version(2)  # the learner's LoadVersion still works
    assert list(driver.status().versions_loaded) == [2]
  finally:
    driver.stop()
