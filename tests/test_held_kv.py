"""Held KV across a tool call (issue 39 item 2): the next turn prefills only its new tokens.

Real engine, real driver, real Orbax snapshots, a tiny random model. Oracles: a
full forward of the learner's ``Transformer`` over prompt + every turn +
observation under the held version (the continuation's log-probs must equal
it), and counts written by hand (which tokens were computed, which reused).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dora.model import CharTokenizer, KVCache, ModelConfig, Transformer, init_params
from jax_dora.rollout import api
from jax_dora.rollout.driver import RolloutDriver
from jax_dora.rollout.engine import DoraEngine
from jax_dora.rollout.held_kv import HeldKV
from jax_dora.snapshots import SnapshotPublisher

from test_multi_version import Collector

TOK = CharTokenizer()
CFG = ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                  d_ff=64, max_seq_len=96)
STOP = ("=", "+", "-")  # a random policy samples one of these about once in 15 tokens


def _continuation_logp(params, prompt: np.ndarray, result: api.RolloutResult, k: int,
                       model_cfg: ModelConfig = CFG) -> np.ndarray:
  """The oracle: the full-forward log-probs (without PAD (0) and BOS (1), which are never
  sampled) of ``result``'s completion tokens after its first ``k``, given everything before."""
  seq = np.concatenate([prompt, result.completion_tokens])
  logits = Transformer(model_cfg).apply({"params": params}, jnp.asarray(seq, jnp.int32)[None],
                                        jnp.arange(len(seq))[None])
  logp = np.asarray(jax.nn.log_softmax(logits[0].at[:, [0, 1]].set(-jnp.inf), axis=-1))
  p = len(prompt)
  return logp[np.arange(p + k - 1, len(seq) - 1), seq[p + k:]]


def _prompt(hold: str) -> np.ndarray:
  """The prompt of hold ``{letter}{i}`` (``"a3"``: ``"3*3"``)."""
  return TOK.encode(f"{hold[1:]}*{hold[1:]}", is_bos=True)[0]


def _next_turn(name: str, hold: str, first: api.RolloutResult, observation=(), **kw
               ) -> api.RolloutRequest:
  """The request continuing turn ``first`` of ``hold`` after ``observation`` (context)."""
  obs = np.asarray(observation, np.int32)
  return api.RolloutRequest(
      name, _prompt(hold), hold=hold,
      resume_tokens=np.concatenate([first.completion_tokens, obs]).astype(np.int32),
      resume_logprobs=np.concatenate([first.logprobs, np.zeros(len(obs), np.float32)]),
      resume_spans=first.spans, **kw)


def test_extend_equals_prefill_of_the_whole_context():
  """The model's extend path: a chunk after cached entries = those positions of a prefill."""
  params = init_params(CFG, jax.random.PRNGKey(0))
  model = Transformer(CFG)
  seq = jax.random.randint(jax.random.PRNGKey(1), (3, 40), 2, CFG.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(40)[None], (3, 40))
  hidden, kv = model.apply({"params": params}, seq, pos, method=Transformer.prefill)
  start = 29
  cache = KVCache.from_prefill(KVCache(k=kv.k[:, :, :start], v=kv.v[:, :, :start]), 96)
  # Rows in another order than the batch: each chunk reads its own cache row.
  rows = jnp.asarray([2, 0, 1])
  h, new = model.apply({"params": params}, seq[rows, start:], pos[:, start:], cache, rows, 32,
                       method=Transformer.extend)
  np.testing.assert_allclose(h, hidden[rows, start:], atol=2e-6)
  np.testing.assert_allclose(new.k, kv.k[:, rows, start:], atol=2e-6)


@pytest.fixture(name="served")
def _served(tmp_path):
  engine = DoraEngine(CFG, TOK, num_slots=4, max_prefill_length=16, temperature=1.0, seed=5)
  publisher = SnapshotPublisher(tmp_path / "snaps", max_to_keep=None)
  driver = RolloutDriver(engine, str(tmp_path / "snaps"), max_versions=2, name="kv",
                         held_kv_slots=2)
  yield publisher, driver
  driver.stop()
  publisher.close()


def _first_turns(col: Collector, n: int, holds: str) -> dict[str, api.RolloutResult]:
  """``n`` first turns (holds ``{holds}{i}``) ending at a stop string after >= 2 tokens."""
  ids = [f"{holds}{i}" for i in range(n)]
  for rid in ids:
    col.submit(api.RolloutRequest(rid, _prompt(rid), max_new_tokens=30, stop_strings=STOP,
                                  hold=rid))
  col.wait(lambda: all(r in col.terminal for r in ids))
  return {r: col.terminal[r] for r in ids if col.terminal[r].finish_reason == "stop"
          and len(col.terminal[r].completion_tokens) >= 2}


def test_next_turn_prefills_only_its_observation_and_stays_exact(served):
  """Two live versions: a held turn on version 0 continues from its held entries while
  version 1 serves new work; its log-probs equal version 0's full forward over prompt +
  turn 1 + observation + turn 2."""
  publisher, driver = served
  params = {v: init_params(CFG, jax.random.PRNGKey(20 + v)) for v in range(2)}
  publisher.publish(0, params[0])
  driver.load_version(0)
  col = Collector(driver)
  firsts = _first_turns(col, 8, "a")
  assert len(firsts) >= 2, "the random policy met no stop string"
  st = driver.status()
  assert st.held_kv_parked == 8 - sum(col.terminal[f"a{i}"].finish_reason != "stop"
                                      for i in range(8))
  assert st.held_kv_entries == 2  # the pool holds two; older entries were evicted
  # Version 1 arrives; new work runs on it while the held turn continues on 0.
  publisher.publish(1, params[1])
  driver.load_version(1)
  observation = TOK.encode(" out: 42 ")[0]
  hold = next(h for h in firsts if h in driver.held.holds())  # one still in the pool
  first, prompt = firsts[hold], _prompt(hold)
  turn2 = _next_turn("turn2", hold, first, observation, max_new_tokens=60)
  resume = turn2.resume_tokens
  before = driver.status()
  col.submit(api.RolloutRequest("other", TOK.encode("7*7", is_bos=True)[0], max_new_tokens=30))
  col.submit(turn2)
  col.wait(lambda: "turn2" in col.terminal and "other" in col.terminal)
  second, after = col.terminal["turn2"], driver.status()
  assert col.terminal["other"].spans[0].version == 1
  assert {sp.version for sp in second.spans} == {0}
  # Reused: prompt + turn 1 less its last token; computed: that token + the observation.
  context = len(prompt) + len(resume)
  reused = len(prompt) + len(first.completion_tokens) - 1
  assert after.held_kv_resumed - before.held_kv_resumed == 1
  assert after.held_kv_reused_tokens - before.held_kv_reused_tokens == reused
  other = len(TOK.encode("7*7", is_bos=True)[0])
  assert (after.prefill_computed_tokens - before.prefill_computed_tokens
          == context - reused + other)
  assert after.resumed_prefill_tokens == before.resumed_prefill_tokens  # nothing re-prefilled
  k = len(resume)
  np.testing.assert_array_equal(second.completion_tokens[:k], resume)
  ref = _continuation_logp(params[0], prompt, second, k)
  assert len(ref) >= 1
  np.testing.assert_allclose(second.logprobs[k:], ref, atol=1e-4)


def test_fallbacks_are_counted_and_still_exact(served):
  """A hold whose entry was evicted, and a next turn on another version, re-prefill."""
  publisher, driver = served
  params = {v: init_params(CFG, jax.random.PRNGKey(30 + v)) for v in range(2)}
  publisher.publish(0, params[0])
  driver.load_version(0)
  col = Collector(driver)
  firsts = _first_turns(col, 8, "b")
  if len(firsts) < 3:
    pytest.skip("the random policy met too few stop strings")
  in_pool = driver.held.holds()
  oldest = next(h for h in firsts if h not in in_pool)  # its entry made room for others
  first = firsts[oldest]
  before = driver.status()
  col.submit(_next_turn("evicted", oldest, first, max_new_tokens=40))
  col.wait(lambda: "evicted" in col.terminal)
  after = driver.status()
  assert after.held_kv_fallbacks["evicted"] - before.held_kv_fallbacks["evicted"] == 1
  assert after.resumed_prefill_tokens - before.resumed_prefill_tokens == len(first.completion_tokens)
  res = col.terminal["evicted"]
  k = len(first.completion_tokens)
  ref = _continuation_logp(params[0], _prompt(oldest), res, k)
  np.testing.assert_allclose(res.logprobs[k:], ref, atol=1e-4)
  # A next turn that names another version than its held entry's re-prefills ("version").
  newest = next(h for h in firsts if h in in_pool)
  publisher.publish(1, params[1])
  driver.load_version(1)
  col.submit(_next_turn("moved", newest, firsts[newest], max_new_tokens=40, version=1))
  col.wait(lambda: "moved" in col.terminal)
  assert driver.status().held_kv_fallbacks["version"] == 1
  assert col.terminal["moved"].spans[-1].version == 1


def test_a_hop_hold_pins_nothing_and_reuses_only_on_the_same_version(served):
  """``keep_version=False`` (orchestrator.turn_version=newest): the turn's version is
  released when it ends; the next turn runs on the newest version, from its held entries
  while that is still the turn's version, else re-prefilling ("version")."""
  publisher, driver = served
  params = {v: init_params(CFG, jax.random.PRNGKey(40 + v)) for v in range(2)}
  publisher.publish(0, params[0])
  driver.load_version(0)
  col = Collector(driver)
  ids = [f"h{i}" for i in range(6)]
  for rid in ids:
    col.submit(api.RolloutRequest(rid, _prompt(rid), max_new_tokens=30, stop_strings=STOP,
                                  hold=rid, keep_version=False))
  col.wait(lambda: all(r in col.terminal for r in ids))
  stopped = [r for r in ids if col.terminal[r].finish_reason == "stop"
             and r in driver.held.holds()]
  if len(stopped) < 2:
    pytest.skip("the random policy met too few stop strings")
  assert driver.status().held_versions == ()  # nothing pinned
  before = driver.status()

  def next_turn(rid: str, name: str) -> api.RolloutResult:
    col.submit(_next_turn(name, rid, col.terminal[rid], max_new_tokens=40, keep_version=False))
    col.wait(lambda: name in col.terminal)
    return col.terminal[name]

  same = next_turn(stopped[0], "same")
  assert {sp.version for sp in same.spans} == {0}
  assert driver.status().held_kv_resumed == before.held_kv_resumed + 1
  publisher.publish(1, params[1])
  driver.load_version(1)
  moved = next_turn(stopped[1], "moved")
  k = len(col.terminal[stopped[1]].completion_tokens)
  assert [sp.version for sp in moved.spans] == [0, 1] and moved.spans[1].start == k
  st = driver.status()
  assert st.held_kv_fallbacks["version"] == before.held_kv_fallbacks["version"] + 1
  assert 0 not in st.versions_loaded or st.held_versions == ()


def test_released_holds_free_their_rows(served):
  publisher, driver = served
  publisher.publish(0, init_params(CFG, jax.random.PRNGKey(0)))
  driver.load_version(0)
  col = Collector(driver)
  firsts = _first_turns(col, 6, "c")
  if not firsts:
    pytest.skip("the random policy met no stop string")
  assert driver.status().held_kv_entries >= 1
  driver.abort([f"c{i}" for i in range(6)])
  col.submit(api.RolloutRequest("tick", TOK.encode("1", is_bos=True)[0], max_new_tokens=2))
  col.wait(lambda: "tick" in col.terminal)
  st = driver.status()
  assert st.held_kv_entries == 0 and st.held_versions == ()


def test_held_kv_table_by_hand():
  """Eviction order, reasons and row reuse of the host table."""
  table = HeldKV(2)
  ctx = np.arange(10, dtype=np.int32)
  r1 = table.park("x", 0, ctx[:5])
  r2 = table.park("y", 0, ctx[:6])
  assert {r1, r2} == {0, 1}
  r3 = table.park("z", 1, ctx[:7])  # evicts x (least recently parked)
  assert r3 == r1 and "x" not in table
  assert table.resume("x", 0, ctx, 100) == (None, "evicted")
  assert table.resume("y", 1, ctx, 100) == (None, "version")
  entry, why = table.resume("z", 1, ctx, 100)
  assert why == "" and entry.pool_row == r3 and len(entry.tokens) == 7
  table.release_row(entry)
  table.park("w", 0, ctx[:4])
  assert table.resume("w", 0, np.array([0, 1, 2, 9, 9]), 100) == (None, "mismatch")
  table.park("v", 0, ctx[:4])
  assert table.resume("v", 0, ctx, 3) == (None, "too_long")  # 6 new tokens > 3
  assert table.resume("nobody", 0, ctx, 100) == (None, "not_held")
  c = table.counters
  assert (c.parked, c.resumed, c.reused_tokens) == (5, 1, 7)
  assert c.fallbacks == {"not_held": 1, "evicted": 1, "version": 1, "mismatch": 1, "too_long": 1}
  assert len(table) == 0 and sorted(table._free) == [0, 1]  # pylint: disable=protected-access


MOE = ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=3, n_heads=2, d_ff=64,
                  max_seq_len=96, num_experts=4, num_experts_per_tok=2, moe_d_ff=16,
                  mlp_only_layers=(1,))


@pytest.mark.parametrize("model_cfg,devices,tp", [(MOE, 1, 1), (CFG, 2, 2)],
                         ids=["moe_routes", "tensor_parallel_2"])
def test_held_resume_on_moe_and_tensor_parallel_servers(tmp_path, model_cfg, devices, tp):
  """An MoE server's held resume records the new tokens' routes (the oracle: the training
  forward's own top-k over the whole sequence) and keeps turn 1's; a tensor-parallel
  server's held resume stays exact."""
  from jax_dora.model import routing  # pylint: disable=g-import-not-at-top

  engine = DoraEngine(model_cfg, TOK, num_slots=4, max_prefill_length=16, temperature=1.0,
                      seed=9, devices=jax.devices()[:devices], tensor_parallel=tp)
  publisher = SnapshotPublisher(tmp_path / "snaps", max_to_keep=None)
  driver = RolloutDriver(engine, str(tmp_path / "snaps"), max_versions=2, name="kv2",
                         held_kv_slots=4)
  try:
    params = init_params(model_cfg, jax.random.PRNGKey(3))
    publisher.publish(0, params)
    driver.load_version(0)
    col = Collector(driver)
    firsts = _first_turns(col, 4, "m")
    if not firsts:
      pytest.skip("the random policy met no stop string")
    hold, first = next(iter(firsts.items()))
    prompt = _prompt(hold)
    observation = TOK.encode(" out: 7 ")[0]
    recorded = None
    if first.routing is not None:
      none = routing.sentinel(model_cfg.num_experts)
      recorded = np.concatenate([first.routing, np.full(
          (len(observation),) + first.routing.shape[1:], none, first.routing.dtype)])
    col.submit(_next_turn("t2", hold, first, observation, max_new_tokens=60,
                          resume_routing=recorded))
    col.wait(lambda: "t2" in col.terminal)
    res = col.terminal["t2"]
    assert driver.status().held_kv_resumed == 1
    seq = np.concatenate([prompt, res.completion_tokens])
    k = len(first.completion_tokens) + len(observation)
    np.testing.assert_allclose(res.logprobs[k:],
                               _continuation_logp(params, prompt, res, k, model_cfg), atol=1e-4)
    if model_cfg is MOE:
      _, rec = Transformer(model_cfg).apply({"params": params}, jnp.asarray(seq)[None],
                                            jnp.arange(len(seq))[None],
                                            mutable=[routing.ROUTING])
      own = np.asarray(routing.collect(rec, model_cfg))[0]
      assert res.routing.shape[0] == len(seq)
      assert np.all(res.routing[:-1] != routing.sentinel(model_cfg.num_experts))
      np.testing.assert_array_equal(np.sort(res.routing[:-1], -1), np.sort(own[:-1], -1))
      np.testing.assert_array_equal(res.routing[:len(first.routing) - 1],
                                    first.routing[:-1])  # turn 1's, as recorded
  finally:
    driver.stop()
    publisher.close()
