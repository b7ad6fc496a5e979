"""Routing replay (issue 26): servers record the experts every token went to; the learner
can route by them.

Real engine, real driver, real Orbax snapshots, a tiny random MoE policy (two MoE
layers around a dense one). The oracle for the record is the model's training
forward on the finished sequence in float32 (a different program from prefill
and decode; ``test_hf_models`` compares the record with transformers' routers);
the replay check is by construction: the learner's forward, given a record,
routes every recorded position exactly as recorded, including experts its own
router would not pick.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jax_dora.learner.batching import make_batch
from jax_dora.learner.train_state import routing_spec
from jax_dora.model import CharTokenizer, ModelConfig, Transformer, init_params
from jax_dora.model import routing
from jax_dora.rollout import api
from jax_dora.rollout.driver import RolloutDriver
from jax_dora.rollout.engine import DoraEngine
from jax_dora.snapshots import SnapshotPublisher
from jax_dora.types import Prompt, TokenSpan, Trajectory

from test_multi_version import Collector

TOK = CharTokenizer()
CFG = ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=3, n_heads=2, d_ff=64,
                  max_seq_len=64, num_experts=4, num_experts_per_tok=2, moe_d_ff=16,
                  mlp_only_layers=(1,))
NONE = routing.sentinel(CFG.num_experts)


def _prompt(i: int) -> np.ndarray:
  return TOK.encode(f"{i}+{i}=", is_bos=True)[0]


@pytest.fixture(name="served", scope="module")
def _served(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("replay")
  engine = DoraEngine(CFG, TOK, num_slots=4, max_prefill_length=16, temperature=1.0, seed=5)
  publisher = SnapshotPublisher(tmp / "snaps", max_to_keep=None)
  params = init_params(CFG, jax.random.PRNGKey(0))
  publisher.publish(0, params)
  driver = RolloutDriver(engine, str(tmp / "snaps"), max_versions=2, name="moe")
  driver.load_version(0)
  yield driver, params
  driver.stop()
  publisher.close()


def _run(driver, requests):
  col = Collector(driver)
  for r in requests:
    col.submit(r)
  col.wait(lambda: all(r.request_id in col.terminal for r in requests))
  return [col.terminal[r.request_id] for r in requests]


def _own_routes(params, tokens: np.ndarray) -> np.ndarray:
  """``[T, moe_layers, k]`` the training forward's own top-k on ``tokens`` (float32)."""
  _, recorded = Transformer(CFG).apply({"params": params}, tokens[None],
                                       np.arange(len(tokens))[None], mutable=[routing.ROUTING])
  return np.asarray(routing.collect(recorded, CFG))[0]


def test_the_server_records_every_token_it_ran(served):
  driver, params = served
  results = _run(driver, [api.RolloutRequest(f"r{i}", _prompt(i), max_new_tokens=20)
                          for i in range(6)])
  for i, res in enumerate(results):
    p, c = len(_prompt(i)), len(res.completion_tokens)
    rec = res.routing
    assert rec.dtype == np.uint8 and rec.shape == (p + c, 2, 2), rec.shape
    # Every prompt token (prefill) and every sampled token but the last (fed
    # back in decode) has its route; the last was never run.
    assert np.all(rec[:-1] != NONE) and np.all(rec[-1] == NONE)
    seq = np.concatenate([_prompt(i), res.completion_tokens])
    np.testing.assert_array_equal(np.sort(rec[:-1], -1), np.sort(_own_routes(params, seq)[:-1], -1))


def test_a_resumed_request_keeps_the_recorded_routes_and_fills_the_gaps(served):
  driver, _ = served
  (first,) = _run(driver, [api.RolloutRequest("a", _prompt(7), max_new_tokens=16,
                                              ignore_eos=True)])
  p = len(_prompt(7))
  cut = 8
  recorded = first.routing[:p + cut].copy()
  recorded[p + cut - 1] = NONE  # e.g. a tool observation: never run yet
  forged = (recorded[3] + 1) % CFG.num_experts
  recorded[3] = forged  # not what the router picks: kept all the same
  (res,) = _run(driver, [api.RolloutRequest(
      "b", _prompt(7), max_new_tokens=16, resume_tokens=first.completion_tokens[:cut],
      resume_logprobs=first.logprobs[:cut], resume_spans=(TokenSpan(0, cut, 0),),
      resume_routing=recorded, ignore_eos=True)])
  assert len(res.completion_tokens) == 16 and len(res.routing) == p + 16
  np.testing.assert_array_equal(res.routing[3], forged)
  np.testing.assert_array_equal(res.routing[:p + cut - 1], recorded[:p + cut - 1])
  # The gap is filled from this request's prefill: the same route as first time.
  np.testing.assert_array_equal(res.routing[p + cut - 1], first.routing[p + cut - 1])
  assert np.all(res.routing[:-1] != NONE)
  (bad,) = _run(driver, [api.RolloutRequest(
      "c", _prompt(7), max_new_tokens=16, resume_tokens=first.completion_tokens[:cut],
      resume_logprobs=first.logprobs[:cut], resume_spans=(TokenSpan(0, cut, 0),),
      resume_routing=recorded[:-1])])
  assert isinstance(bad, api.RolloutError) and "resume_routing" in str(bad)


def _trajectory(i: int, res: api.RolloutResult) -> Trajectory:
  return Trajectory(sample_id=i, member=0, prompt=Prompt(i, "t", "", ""),
                    prompt_tokens=_prompt(i), completion_tokens=res.completion_tokens,
                    behaviour_logprobs=res.logprobs, spans=list(res.spans),
                    finish_reason=res.finish_reason, routing=res.routing)


def test_replay_routes_every_recorded_position_as_recorded(served):
  """The learner's forward with ``replay_routing`` uses the batch's record, forged
  routes included; ``moe/route_mismatch`` counts the recorded routes its own router
  would not pick (0 for an untouched record, the forged share otherwise)."""
  driver, params = served
  results = _run(driver, [api.RolloutRequest(f"x{i}", _prompt(i), max_new_tokens=12)
                          for i in range(4)])
  trajs = [_trajectory(i, r) for i, r in enumerate(results)]
  assert all(t.unrouted_positions() == 0 for t in trajs)
  batch = make_batch(trajs, np.zeros(4), 32, routing=routing_spec(CFG))
  rec = batch["routing"]
  assert rec.shape == (4, 31, 2, 2) and rec.dtype == np.uint8
  forged = rec.copy()
  forged[:, 2] = (forged[:, 2] + 1) % CFG.num_experts  # position 2 of every row, both layers
  real = np.asarray(batch["mask"]) >= 0  # every position counts for the statistics

  def forward(replay: bool, record: np.ndarray):
    _, out = Transformer(CFG, replay_routing=replay).apply(
        {"params": params}, batch["inputs"], batch["positions"], token_mask=real,
        routing=record, mutable=[routing.ROUTING, "intermediates"])
    used = np.asarray(routing.collect(out, CFG))
    stats = out["intermediates"]
    diff = sum(float(np.sum(stats[f"layers_{i}"]["mlp"]["router_stats"][0]["route_diff"]))
               for i in (0, 2))
    total = sum(float(np.sum(stats[f"layers_{i}"]["mlp"]["router_stats"][0]["routed"]))
                for i in (0, 2))
    return used, diff / total

  has = np.all(rec != NONE, axis=(-2, -1))
  # Forged experts the router does not pick (its own choice is the record), by hand.
  missed = sum(len(set(forged[b, 2, layer]) - set(rec[b, 2, layer]))
               for b in range(4) for layer in range(2))
  assert missed > 0
  want = missed / (has.sum() * 2 * 2)
  used, mismatch = forward(False, forged)  # recompute: its own routes, the forged ones missed
  np.testing.assert_array_equal(np.sort(used[has], -1), np.sort(rec[has], -1))
  assert mismatch == pytest.approx(want)
  used, mismatch = forward(True, forged)
  np.testing.assert_array_equal(np.sort(used[has], -1), np.sort(forged[has], -1))
  # Replaying the forged experts changes later positions' hidden states, so the
  # router's own picks there move too: at least the forged share.
  assert mismatch >= want
  _, mismatch = forward(True, rec)
  assert mismatch == 0.0
