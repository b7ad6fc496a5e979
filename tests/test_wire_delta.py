"""Multi-turn turns over gRPC without the held context (issue 39 item 2, ``rollout/wire_delta.py``).

By hand: what a next turn's delta carries, what a result delta strips, and every
case that must go in full. End to end: a real ``RolloutServer`` and driver
(real engine, held KV, Orbax snapshot) on loopback gRPC, a real client; the
oracles are the learner's full forward over prompt + turn 1 + observation +
turn 2 under the held version, and the frame sizes of the same request and
result sent whole (``wire.dumps``, which the delta code does not touch).
"""

from __future__ import annotations

import asyncio
import dataclasses

import jax
import numpy as np
import pytest

from jax_dora.model import CharTokenizer, ModelConfig, init_params
from jax_dora.rollout import api
from jax_dora.rollout import wire
from jax_dora.rollout import wire_delta
from jax_dora.rollout.client import GrpcRolloutClient
from jax_dora.rollout.driver import RolloutDriver
from jax_dora.rollout.engine import DoraEngine
from jax_dora.rollout.server import RolloutServer
from jax_dora.snapshots import SnapshotPublisher
from jax_dora.types import TokenSpan

from test_held_kv import _continuation_logp

pytestmark = pytest.mark.timeout(180)

TOK = CharTokenizer()
CFG = ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                  d_ff=64, max_seq_len=128)
STOP = ("=", "+", "-")


def _i32(*xs) -> np.ndarray:
  return np.asarray(xs, np.int32)


def _f32(*xs) -> np.ndarray:
  return np.asarray(xs, np.float32)


def _turn1(hold: str = "h") -> tuple[api.RolloutRequest, api.RolloutResult]:
  req = api.RolloutRequest("r1", _i32(1, 5, 6), 8, hold=hold, stop_strings=("=",))
  res = api.RolloutResult("r1", _i32(7, 8, 9), _f32(-0.5, -1.0, -1.5), (TokenSpan(0, 3, 4),),
                          "stop", prefill_version=4)
  return req, res


def _turn2(**kw) -> api.RolloutRequest:
  """Turn 1's completion, then the observation [20, 21] (context: log-prob 0)."""
  fields = dict(prompt_tokens=_i32(1, 5, 6), resume_tokens=_i32(7, 8, 9, 20, 21),
                resume_logprobs=_f32(-0.5, -1.0, -1.5, 0, 0), resume_spans=(TokenSpan(0, 3, 4),),
                hold="h")
  fields.update(kw)
  return api.RolloutRequest("r2", max_new_tokens=8, **fields)


def test_a_next_turn_carries_only_its_observation():
  ends = wire_delta.HeldContexts(), wire_delta.HeldContexts()  # client, server
  for table in ends:
    table.after_result(*_turn1())
  msg = wire_delta.encode_request(ends[0], _turn2())
  assert isinstance(msg, wire.ResumeDelta) and msg.base_tokens == 3
  assert msg.request.prompt_tokens.tolist() == []
  assert msg.request.resume_tokens.tolist() == [20, 21]
  assert msg.request.resume_logprobs.tolist() == [0, 0]
  assert msg.request.resume_spans == (TokenSpan(0, 3, 4),)  # spans travel whole
  # Through the real codec, then expanded: the request the orchestrator made.
  full = wire_delta.expand_request(ends[1], wire.loads(wire.dumps(msg)))
  assert full.prompt_tokens.tolist() == [1, 5, 6]
  assert full.resume_tokens.tolist() == [7, 8, 9, 20, 21]
  assert full.resume_logprobs.tolist() == [-0.5, -1.0, -1.5, 0, 0]
  assert (full.hold, full.request_id, full.max_new_tokens) == ("h", "r2", 8)
  # Its result, stripped of the 5 tokens the request carried and put back.
  res = api.RolloutResult("r2", _i32(7, 8, 9, 20, 21, 30, 31), _f32(-0.5, -1, -1.5, 0, 0, -2, -3),
                          (TokenSpan(0, 3, 4), TokenSpan(5, 7, 4)), "eos", prefill_version=4)
  back = wire_delta.strip_result(full, res)
  assert isinstance(back, wire.ResultDelta) and back.offset == 5
  assert back.result.completion_tokens.tolist() == [30, 31]
  whole = wire_delta.restore_result(_turn2(), wire.loads(wire.dumps(back)))
  assert whole.completion_tokens.tolist() == [7, 8, 9, 20, 21, 30, 31]
  assert whole.logprobs.tolist() == [-0.5, -1, -1.5, 0, 0, -2, -3]
  assert whole.spans == res.spans
  # "eos": no next turn, so neither end keeps a base.
  for table in ends:
    table.after_result(full, res)
    assert len(table) == 0


@pytest.mark.parametrize("change", ["prompt", "token", "logprob", "hold", "no_resume"])
def test_what_differs_from_the_base_goes_in_full(change):
  table = wire_delta.HeldContexts()
  table.after_result(*_turn1())
  req = {"prompt": _turn2(prompt_tokens=_i32(1, 5, 7)),
         "token": _turn2(resume_tokens=_i32(7, 8, 3, 20, 21)),
         "logprob": _turn2(resume_logprobs=_f32(-0.5, -1.0, -1.25, 0, 0)),
         "hold": _turn2(hold="other"),
         "no_resume": _turn2(resume_tokens=None, resume_logprobs=None)}[change]
  assert wire_delta.encode_request(table, req) is req


def test_a_server_without_that_exact_base_asks_for_the_request_in_full():
  client, server = wire_delta.HeldContexts(), wire_delta.HeldContexts()
  client.after_result(*_turn1())
  msg = wire_delta.encode_request(client, _turn2())
  with pytest.raises(wire.ResumeBaseMissingError, match="send it in full"):
    wire_delta.expand_request(server, msg)  # a restarted server: no bases
  req1, res1 = _turn1()
  server.after_result(req1, api.RolloutResult("r1", _i32(7, 8, 2), _f32(-0.5, -1.0, -1.5),
                                              res1.spans, "stop", prefill_version=4))
  with pytest.raises(wire.ResumeBaseMissingError):
    wire_delta.expand_request(server, msg)  # same length, other tokens: the CRC differs
  server.forget(["h"])
  assert len(server) == 0
  # The error travels in-band and comes back as the same type (the client resends).
  err = wire.loads(wire.dumps(wire.WireError.from_exception(
      wire.ResumeBaseMissingError("gone"), "r2"))).to_exception()
  assert isinstance(err, wire.ResumeBaseMissingError) and err.failed_request_ids == ("r2",)


def test_moe_routes_follow_the_base_and_rows_the_prefill_filled_go_back():
  # Routes: [prompt 3 + completion, 1 layer, k=1]; 255 = none recorded (uint8 sentinel).
  req1, res1 = _turn1()
  res1 = api.RolloutResult("r1", res1.completion_tokens, res1.logprobs, res1.spans, "stop", 4,
                           routing=np.asarray([0, 1, 2, 3, 0, 255], np.uint8).reshape(6, 1, 1))
  client, server = wire_delta.HeldContexts(), wire_delta.HeldContexts()
  client.after_result(req1, res1)
  server.after_result(req1, res1)
  routes = np.asarray([0, 1, 2, 3, 0, 255, 255, 255], np.uint8).reshape(8, 1, 1)
  msg = wire_delta.encode_request(client, _turn2(resume_routing=routes))
  assert msg.request.resume_routing.ravel().tolist() == [255, 255]  # the observation's rows
  full = wire_delta.expand_request(server, msg)
  np.testing.assert_array_equal(full.resume_routing, routes)
  # The prefill filled the rows the request lacked: those rows must go back.
  filled = np.asarray([0, 1, 2, 3, 0, 3, 1, 2, 0, 255], np.uint8).reshape(10, 1, 1)
  res = api.RolloutResult("r2", _i32(7, 8, 9, 20, 21, 30, 31), np.zeros(7, np.float32),
                          (TokenSpan(0, 3, 4), TokenSpan(5, 7, 4)), "eos", 4, routing=filled)
  res = dataclasses.replace(res, logprobs=_f32(-0.5, -1.0, -1.5, 0, 0, -2, -3))  # as sent
  back = wire_delta.strip_result(full, res)
  assert (back.offset, back.routing_offset) == (5, 0)
  np.testing.assert_array_equal(wire_delta.restore_result(_turn2(resume_routing=routes),
                                                          back).routing, filled)
  # A base with routes and a request without them (or the reverse) goes in full.
  req = _turn2()
  assert wire_delta.encode_request(client, req) is req


def test_the_table_is_bounded_and_released_holds_go():
  table = wire_delta.HeldContexts(capacity=2)
  for hold in ("a", "b", "c"):
    table.after_result(*_turn1(hold))
  assert table.get("a") is None and table.get("b") is not None and len(table) == 2
  table.forget(["c", "not-a-hold"])
  assert len(table) == 1
  off = wire_delta.HeldContexts(capacity=0)  # rollout.resume_deltas=False
  off.after_result(*_turn1())
  assert len(off) == 0


# ------------------------------------------------------------------ end to end over gRPC
async def _serve(driver, port: int = 0) -> RolloutServer:
  for _ in range(50):  # a port just released may take a moment
    server = RolloutServer(driver, port, host="127.0.0.1", name="wire")
    try:
      await server.start()
      return server
    except (OSError, RuntimeError):
      await asyncio.sleep(0.1)
  raise AssertionError("could not bind the rollout server")


async def test_turns_travel_as_deltas_and_stay_exact(tmp_path):
  """Turn 2 goes as a delta and comes back whole: its log-probs are the held version's full
  forward, the server still resumes from its held KV, and both frames are smaller than the
  same request and result sent whole by at least the context they left out. Then the server
  restarts (its bases are gone): the next delta is refused and resent in full, still exact."""
  engine = DoraEngine(CFG, TOK, num_slots=4, max_prefill_length=64, temperature=1.0, seed=3)
  publisher = SnapshotPublisher(tmp_path / "snaps", max_to_keep=None)
  driver = RolloutDriver(engine, str(tmp_path / "snaps"), max_versions=2, name="wire",
                         held_kv_slots=4)
  params = init_params(CFG, jax.random.PRNGKey(7))
  publisher.publish(0, params)
  driver.load_version(0)
  server = await _serve(driver)
  client = GrpcRolloutClient(server.address)
  try:
    prompt = TOK.encode("12*34 is the product of two numbers; what is it", is_bos=True)[0]
    holds = [f"h{i}" for i in range(6)]
    firsts = await asyncio.gather(*(client.generate(api.RolloutRequest(
        f"{h}-t1", prompt, 30, hold=h, stop_strings=STOP)) for h in holds))
    firsts = {h: r for h, r in zip(holds, firsts)
              if r.finish_reason == "stop" and len(r.completion_tokens) >= 2}
    assert len(firsts) >= 2, "the random policy met no stop string"
    assert client.wire_counters()["sent_full"] == 6
    observation = TOK.encode(" out: 1428 ")[0]

    def turn2(hold: str, rid: str) -> api.RolloutRequest:
      first = firsts[hold]
      return api.RolloutRequest(
          rid, prompt, 20, hold=hold, stop_strings=STOP,
          resume_tokens=np.concatenate([first.completion_tokens, observation]).astype(np.int32),
          resume_logprobs=np.concatenate([first.logprobs, np.zeros(len(observation), np.float32)]),
          resume_spans=first.spans)

    hold = next(iter(firsts))
    before_wire, before = client.wire_counters(), driver.status()
    req = turn2(hold, f"{hold}-t2")
    second = await client.generate(req)
    after_wire, after = client.wire_counters(), driver.status()
    assert after_wire["sent_delta"] - before_wire["sent_delta"] == 1
    assert after.held_kv_resumed - before.held_kv_resumed == 1  # the driver got it whole
    k = len(req.resume_tokens)
    np.testing.assert_array_equal(second.completion_tokens[:k], req.resume_tokens)
    np.testing.assert_array_equal(second.logprobs[:k], req.resume_logprobs)
    ref = _continuation_logp(params, prompt, second, k, CFG)
    assert len(ref) >= 1
    np.testing.assert_allclose(second.logprobs[k:], ref, atol=1e-4)
    # Frames: the same request and result whole would be larger by at least the prompt's and
    # turn 1's ids (4 bytes each) and turn 1's log-probs, less a few bytes of delta header.
    left_out = 4 * len(prompt) + 8 * len(firsts[hold].completion_tokens)
    sent = after_wire["request_bytes"] - before_wire["request_bytes"]
    got = after_wire["result_bytes"] - before_wire["result_bytes"]
    whole_request = len(wire.dumps(dataclasses.replace(req, stream=False)))
    assert sent <= whole_request - left_out + 64, (sent, whole_request, left_out)
    assert got <= len(wire.dumps(second)) - 8 * k + 64, (got, len(wire.dumps(second)), k)

    # A restarted server process at the same address has no bases: refused, sent again whole.
    port = server.port
    await server.stop(0)
    server = await _serve(driver, port)
    others = [h for h in firsts if h != hold]
    if second.finish_reason == "stop":  # turn 3 of the same hold, else another hold's turn 2
      obs = TOK.encode(" ok ")[0]
      req = api.RolloutRequest(
          f"{hold}-t3", prompt, 20, hold=hold, stop_strings=STOP,
          resume_tokens=np.concatenate([second.completion_tokens, obs]).astype(np.int32),
          resume_logprobs=np.concatenate([second.logprobs, np.zeros(len(obs), np.float32)]),
          resume_spans=second.spans)
    else:
      req = turn2(others[0], f"{others[0]}-t2")
    before_wire = client.wire_counters()
    for _ in range(100):  # the channel reconnects after the restart
      try:
        third = await client.generate(req)
        break
      except api.RolloutError as e:
        if isinstance(e, wire.ResumeBaseMissingError):
          raise
        await asyncio.sleep(0.1)
    after_wire = client.wire_counters()
    assert after_wire["sent_base_missing"] - before_wire["sent_base_missing"] == 1
    k = len(req.resume_tokens)
    np.testing.assert_array_equal(third.completion_tokens[:k], req.resume_tokens)
    np.testing.assert_allclose(third.logprobs[k:], _continuation_logp(params, prompt, third, k, CFG),
                               atol=1e-4)
  finally:
    await client.close()
    await server.stop(0)
    driver.stop()
    publisher.close()

