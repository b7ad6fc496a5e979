"""gRPC server mode end to end: a real server process, real gRPC on loopback.

The server runs as a subprocess (``python -m jax_dora.rollout.server_main``)
with the real ``RolloutDriver`` + ``DoraEngine`` on a tiny model, loading a
snapshot published here with the learner's parameter layout. That is the only
way to test what matters in server mode: that a server process dying (SIGKILL,
no chance to say goodbye) surfaces promptly on the client as a
``RolloutError`` naming every request that was in flight, so that the
orchestrator can re-issue them.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import asyncio
import pathlib
import signal
import time

import jax
import numpy as np
import pytest
from _harness import RolloutServerProcess

from jax_dora import config as config_lib
from jax_dora.model import CharTokenizer
from jax_dora.model import ModelConfig
from jax_dora.model import init_params
from jax_dora.rollout import api
from jax_dora.rollout import wire
from jax_dora.rollout.client import GrpcRolloutClient
from jax_dora.rollout.client import connect_all
from jax_dora.snapshots import SnapshotPublisher
from jax_dora.types import TokenSpan

pytestmark = pytest.mark.timeout(120)

_VERSION = 3  # deliberately not 0/1 so a default cannot pass for the real value
_SLOTS = 2
_MAX_NEW = 24  # per request; the server's buffers keep the tiny.py sizes
# Tiny model: startup (imports + compile) dominates, decoding is instant.
_OVERRIDES = dict(d_model=32, n_layers=1, n_heads=2, d_ff=64)
_TOK = CharTokenizer()
_READY_S = 75.0  # server start-up (imports + compile) allowed before a test fails


def _run_config():
  c = config_lib.base_config()
  c.model.update(_OVERRIDES)
  c.rollout.slots = _SLOTS
  return c


@pytest.fixture(scope="module")
def snapshot_dir(tmp_path_factory) -> pathlib.Path:
  """A snapshot in the learner's layout, published before any server starts."""
  c = _run_config()
  cfg = ModelConfig.from_config_dict(c.model, vocab_size=_TOK.vocab_size)
  params = init_params(cfg, jax.random.PRNGKey(0))
  d = tmp_path_factory.mktemp("snaps")
  with SnapshotPublisher(d) as pub:
    pub.publish(_VERSION, params, {"learner_step": _VERSION})
  return d


def _start_server(snapshot_dir: pathlib.Path, log_path: pathlib.Path) -> RolloutServerProcess:
  return RolloutServerProcess(snapshot_dir, log_path, slots=_SLOTS, model_overrides=_OVERRIDES)


@pytest.fixture(scope="module")
def server(snapshot_dir, tmp_path_factory):
  s = _start_server(snapshot_dir, tmp_path_factory.mktemp("srv") / "server.log")
  try:
    s.wait_ready(_READY_S)
    yield s
    # SIGTERM is the launcher's way to stop a server: it must exit cleanly.
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(30) == 0, s.log()[-3000:]
    log = s.log()
    assert f"serving on {s.address}, versions loaded [{_VERSION}]" in log, log
    assert "stopped" in log, log[-3000:]
  finally:
    s.close()


def _request(rid: str, text: str = "12+3=", max_new: int = _MAX_NEW, **kw):
  prompt = np.concatenate([[_TOK.bos_id], _TOK.encode_ids(text)]).astype(np.int32)
  return api.RolloutRequest(rid, prompt, max_new, **kw)


def test_wire_round_trip():
  r = _request(
      "r", resume_tokens=np.array([5, 6], np.int32),
      resume_logprobs=np.array([-0.5, -1.0], np.float32),
      resume_spans=(TokenSpan(0, 2, 1),),
  )
  back = wire.loads(wire.dumps(r))
  assert back.resume_spans == r.resume_spans and back.version is None
  np.testing.assert_array_equal(back.prompt_tokens, r.prompt_tokens)
  assert back.prompt_tokens.dtype == np.int32
  np.testing.assert_array_equal(back.resume_logprobs, r.resume_logprobs)
  s = api.ServerStatus((1, 2), 2, 1, 4, 0, (2,), 10, 0.5)
  assert wire.loads(wire.dumps(s)) == s
  with pytest.raises(wire.WireFormatError, match="unknown wire type"):
    wire.loads(wire.dumps({"__dc__": "Popen"}))
  with pytest.raises(wire.WireFormatError):
    wire.loads(b"\xc1 not msgpack")


def test_connect_all_parses_addresses():
  clients = connect_all("10.0.0.1:9000, host-b:9001,")
  assert [c.address for c in clients] == ["10.0.0.1:9000", "host-b:9001"]
  with pytest.raises(ValueError, match="host:port"):
    connect_all("nohostport")


async def test_streams_tokens_logprobs_and_version(server):
  client = GrpcRolloutClient(server.address, timeout_s=60)
  try:
    health = await client.health()
    assert health["live"] and health["versions_loaded"] == [_VERSION]

    async def one(i: int):
      chunks, result = [], None
      async for item in client.stream(_request(f"ok-{i}", text=f"{i}+{i}=")):
        if isinstance(item, api.RolloutResult):
          result = item
        else:
          assert isinstance(item, api.RolloutChunk)
          chunks.append(item)
      return chunks, result

    outs = await asyncio.gather(*(one(i) for i in range(5)))  # > slots: queueing
    for i, (chunks, res) in enumerate(outs):
      assert res is not None and res.request_id == f"ok-{i}"
      n = len(res.completion_tokens)
      assert 1 <= n <= _MAX_NEW
      assert res.completion_tokens.dtype == np.int32
      assert res.logprobs.dtype == np.float32 and len(res.logprobs) == n
      assert np.all(res.logprobs <= 0.0) and np.all(np.isfinite(res.logprobs))
      assert res.spans == (TokenSpan(0, n, _VERSION),)
      assert res.prefill_version == _VERSION
      assert res.finish_reason in ("eos", "length")
      if res.finish_reason == "length":
        assert n == _MAX_NEW
      else:
        assert res.completion_tokens[-1] == _TOK.eos_id
      # The stream carried exactly the final tokens/logprobs, in order.
      assert chunks and all(c.version == _VERSION for c in chunks)
      np.testing.assert_array_equal(
          np.concatenate([c.tokens for c in chunks]), res.completion_tokens
      )
      np.testing.assert_allclose(
          np.concatenate([c.logprobs for c in chunks]), res.logprobs
      )
    assert client.in_flight == ()
    status = await client.status()
    assert status.versions_loaded == (_VERSION,)
    assert status.newest_version == _VERSION
    assert status.total_slots == _SLOTS
    assert status.generated_tokens >= sum(len(r.completion_tokens) for _, r in outs)
  finally:
    await client.close()


async def test_load_missing_version_is_a_clear_error(server):
  client = GrpcRolloutClient(server.address, timeout_s=30)
  try:
    with pytest.raises(api.VersionUnavailableError) as e:
      await client.load_version(99)
    msg = str(e.value)
    assert "99" in msg and server.address in msg, msg
    # The server is unharmed and still serves the version it has.
    res = await client.generate(_request("after-missing"))
    assert res.spans[0].version == _VERSION
  finally:
    await client.close()


async def test_abort_returns_partial(server):
  client = GrpcRolloutClient(server.address, timeout_s=30)
  try:
    # Saturate the slots so the aborted request is still queued or decoding.
    reqs = [_request(f"ab-{i}") for i in range(2 * _SLOTS + 1)]
    tasks = [asyncio.ensure_future(client.generate(r)) for r in reqs]
    await asyncio.sleep(0)
    await client.abort([r.request_id for r in reqs])
    results = await asyncio.gather(*tasks)
    for r in results:
      assert r.finish_reason in ("aborted", "eos", "length")
      n = len(r.completion_tokens)
      assert len(r.logprobs) == n
      assert sum(s.end - s.start for s in r.spans) == n
  finally:
    await client.close()


async def test_client_cancel_aborts_on_server(server):
  """A caller that stops listening must free its slot on the server."""
  client = GrpcRolloutClient(server.address, timeout_s=30)
  try:
    # Retried only because a random policy may emit EOS before we cancel.
    for attempt in range(5):
      rid = f"cancel-{attempt}"
      agen = client.stream(_request(rid, max_new=48))
      first = await agen.__anext__()
      if isinstance(first, api.RolloutResult):
        continue
      await agen.aclose()  # what `break` / task cancellation does
      assert rid not in client.in_flight
      needle = f"request {rid} cancelled by client; aborting"
      deadline = time.monotonic() + 10
      while needle not in server.log():
        assert time.monotonic() < deadline, server.log()[-2000:]
        await asyncio.sleep(0.05)
      break
    else:
      pytest.fail("every attempt finished before it could be cancelled")
    deadline = time.monotonic() + 10
    while (status := await client.status()).active_slots:
      assert time.monotonic() < deadline, status  # the slot was freed
      await asyncio.sleep(0.05)
    assert status.queued_requests == 0
  finally:
    await client.close()


async def test_sigkill_mid_stream_reports_every_in_flight_request(
    snapshot_dir, tmp_path
):
  srv = _start_server(snapshot_dir, tmp_path / "killed.log")
  try:
    await asyncio.to_thread(srv.wait_ready, _READY_S)  # sync channel: no second loop
    client = GrpcRolloutClient(srv.address, timeout_s=60)
    n = 4 * _SLOTS  # more than the slots: some are queued, none can finish first
    ids = [f"kill-{i}" for i in range(n)]
    first_chunk = asyncio.Event()
    failures: list[api.RolloutError] = []  # in the order the client raised them
    finished: list[str] = []

    async def one(rid: str):
      try:
        async for item in client.stream(_request(rid)):
          if isinstance(item, api.RolloutChunk):
            first_chunk.set()
          elif isinstance(item, api.RolloutResult):
            finished.append(rid)
      except api.RolloutError as e:
        failures.append(e)
        raise

    tasks = [asyncio.ensure_future(one(r)) for r in ids]
    await asyncio.wait_for(first_chunk.wait(), 30)
    in_flight_at_kill = set(client.in_flight)
    srv.proc.send_signal(signal.SIGKILL)
    t_kill = time.monotonic()
    outcomes = await asyncio.wait_for(
        asyncio.gather(*tasks, return_exceptions=True), 10
    )
    elapsed = time.monotonic() - t_kill
    assert elapsed < 10.0

    assert failures, "killing the server mid-stream raised nothing"
    lost = {r for r, o in zip(ids, outcomes) if isinstance(o, BaseException)}
    assert all(
        isinstance(o, api.RolloutError)
        for o in outcomes
        if isinstance(o, BaseException)
    ), outcomes
    # Nothing silently dropped: each request either finished or failed.
    assert lost | set(finished) == set(ids) and not lost & set(finished)
    assert lost <= in_flight_at_kill
    # The first failure already names every request that was lost, plus the
    # address, so one error suffices to re-issue them all.
    assert set(failures[0].failed_request_ids) == lost
    assert srv.address in str(failures[0])
    for rid, o in zip(ids, outcomes):
      if isinstance(o, api.RolloutError):
        assert o.failed_request_ids[0] == rid
    assert client.in_flight == ()
    # Calls on a dead server fail fast with the same error type.
    with pytest.raises(api.RolloutError, match=srv.address):
      await client.status()
    await client.close()
  finally:
    srv.close()
