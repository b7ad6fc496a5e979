"""DoraEngine: KV-cache decode must agree with the full-sequence forward pass.

This is the check that continuous batching is numerically invisible: two
prompts inserted into different slots at different times, decoded together,
must produce exactly what a fresh full forward over each sequence predicts.
"""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dora.model import CharTokenizer, ModelConfig, Transformer, init_params
from jax_dora.rollout.engine import DoraEngine, DoraResultTokens, MultiVersionParams
from jax_dora.rollout.sampling import sample_tokens

TOK = CharTokenizer()
CFG = ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=48)


def _engine(temperature: float, num_slots: int = 4, seed: int = 0, **kw) -> DoraEngine:
  # Softmax chunks of 20 entries: the 32- and 48-entry length buckets are
  # read in two and three chunks, so decodes below cross chunk edges.
  kw.setdefault("attention_block", 20)
  return DoraEngine(CFG, TOK, num_slots=num_slots, max_prefill_length=16,
                    temperature=temperature, seed=seed, **kw)


def _prompt(text: str) -> np.ndarray:
  return TOK.encode(text, is_bos=True)[0]


# The character tokenizer's PAD and BOS are never sampled: the oracle drops
# them from the distribution by hand.
_NEVER_SAMPLED = [0, 1]


def _full_logp(params, seq: np.ndarray, temperature: float = 1.0) -> np.ndarray:
  """log_softmax of the full (cache-free) forward without PAD/BOS, ``[T, V]``."""
  seq = jnp.asarray(seq, jnp.int32)[None]
  logits = Transformer(CFG).apply({"params": params}, seq, jnp.arange(seq.shape[1])[None])
  logits = (logits[0] / temperature).at[:, _NEVER_SAMPLED].set(-jnp.inf)
  return np.asarray(jax.nn.log_softmax(logits, axis=-1))


def _run(engine, params, prompts, insert_at, steps):
  """Inserts prompt i before generate step ``insert_at[i]``; returns per-slot tokens/logprobs."""
  mv = MultiVersionParams.single(0, params)
  state = engine.init_decode_state()
  out = {i: ([], []) for i in range(len(prompts))}
  slots = {0: 1, 1: 3}  # prompt index -> slot (non-adjacent on purpose)
  live = set()
  for step in range(steps):
    for i, at in enumerate(insert_at):
      if at == step:
        padded, n = engine.pad_tokens(prompts[i])
        prefix = engine.prefill(params=mv, padded_tokens=padded, true_length=n)
        state = engine.insert(prefix, state, slots[i])
        out[i][0].append(int(prefix.token))
        out[i][1].append(float(prefix.logprob))
        live.add(i)
    state, res = engine.generate(mv, state)
    assert isinstance(res, DoraResultTokens)
    res = res.convert_to_numpy()
    assert isinstance(res, DoraResultTokens)
    for i in live:
      sd = res.get_result_at_slot(slots[i])
      assert sd.valid[0, 0] == 1
      out[i][0].append(int(sd.tokens[0, 0]))
      out[i][1].append(float(res.get_logprobs_at_slot(slots[i])[0]))
      assert sd.lengths[0] == len(out[i][0])
  return out


def test_greedy_decode_matches_full_forward_and_logprobs():
  engine = _engine(temperature=0.0)
  params = engine.place_params(init_params(CFG, jax.random.PRNGKey(1)))
  prompts = [_prompt("12+34="), _prompt("sort: c a b")]
  out = _run(engine, params, prompts, insert_at=(0, 3), steps=9)
  for i, p in enumerate(prompts):
    toks, lps = out[i]
    seq = np.concatenate([p, np.asarray(toks, np.int32)])
    logp = _full_logp(params, seq)
    n = len(p)
    # (a) greedy: every generated token is the argmax of the full forward.
    expected = logp[n - 1:len(seq) - 1].argmax(-1)
    np.testing.assert_array_equal(np.asarray(toks), expected)
    # (b) reported logprob == log_softmax of the full forward at that position.
    ref = logp[np.arange(n - 1, len(seq) - 1), seq[n:]]
    np.testing.assert_allclose(np.asarray(lps), ref, atol=1e-4)


def test_sampled_logprobs_match_full_forward_at_temperature():
  temperature = 0.7
  engine = _engine(temperature=temperature, seed=3)
  params = engine.place_params(init_params(CFG, jax.random.PRNGKey(2)))
  prompts = [_prompt("abc"), _prompt("9*9=")]
  out = _run(engine, params, prompts, insert_at=(0, 2), steps=7)
  for i, p in enumerate(prompts):
    toks, lps = out[i]
    seq = np.concatenate([p, np.asarray(toks, np.int32)])
    logp = _full_logp(params, seq, temperature)
    n = len(p)
    ref = logp[np.arange(n - 1, len(seq) - 1), seq[n:]]
    np.testing.assert_allclose(np.asarray(lps), ref, atol=1e-4)


def test_multi_version_generate_commits_only_pinned_version():
  """Two slots pinned to two versions decoded together == each alone."""
  engine = _engine(temperature=0.0)
  pa = engine.place_params(init_params(CFG, jax.random.PRNGKey(10)))
  pb = engine.place_params(init_params(CFG, jax.random.PRNGKey(11)))
  both = MultiVersionParams({1: pa, 2: pb}, (1, 2))
  p = _prompt("hello")
  padded, n = engine.pad_tokens(p)
  state = engine.init_decode_state()
  state = engine.insert(engine.prefill(params=pa, version=1, padded_tokens=padded, true_length=n), state, 0)
  state = engine.insert(engine.prefill(params=pb, version=2, padded_tokens=padded, true_length=n), state, 2)
  toks = {0: [], 2: []}
  for _ in range(5):
    state, res = engine.generate(both, state)
    res = res.convert_to_numpy()
    for s in toks:
      toks[s].append(int(res.get_result_at_slot(s).tokens[0, 0]))
  np.testing.assert_array_equal(np.asarray(state.version)[[0, 2]], [1, 2])
  for slot, params in ((0, pa), (2, pb)):
    first = int(engine.prefill(params=params, padded_tokens=padded, true_length=n).token)
    seq = np.concatenate([p, [first], toks[slot]]).astype(np.int32)
    logp = _full_logp(params, seq)
    np.testing.assert_array_equal(toks[slot], logp[n:len(seq) - 1].argmax(-1))


def test_generate_compiles_once():
  engine = _engine(temperature=1.0)
  params = MultiVersionParams.single(0, engine.place_params(init_params(CFG, jax.random.PRNGKey(0))))
  state = engine.init_decode_state()
  padded, n = engine.pad_tokens(_prompt("ab"))
  for slot in range(3):
    state = engine.insert(engine.prefill(params=params, padded_tokens=padded, true_length=n), state, slot)
    state, _ = engine.generate(params, state)
  compiled = engine.programs.compiled()
  assert compiled["decode"] == compiled["insert"] == compiled["prefill_prefix"] == 1


def test_sample_tokens_top_p_keeps_logprob_untruncated():
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
  toks, lps = sample_tokens(jnp.repeat(logits, 256, 0), jax.random.PRNGKey(0), 1.0, top_p=0.6)
  assert set(np.asarray(toks).tolist()) <= {0, 1}  # nucleus {0.5, 0.3}
  np.testing.assert_allclose(np.asarray(lps), np.log([0.5, 0.3, 0.15, 0.05])[np.asarray(toks)], atol=1e-5)
  g, glp = sample_tokens(logits, jax.random.PRNGKey(0), 0.0)
  assert int(g[0]) == 0 and np.isclose(float(glp[0]), np.log(0.5), atol=1e-5)


def test_prefill_rejects_overlong():
  engine = _engine(temperature=0.0)
  with pytest.raises(ValueError):
    engine.pad_tokens(np.ones((CFG.max_seq_len + 1,), np.int32))


def test_static_generate_matches_full_forward_greedy():
  # The static-batching baseline of benchmarks/rollout_throughput.py.
  import sys  # pylint: disable=g-import-not-at-top

  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
  from static_batch import StaticStats, static_generate  # pylint: disable=g-import-not-at-top
  engine = _engine(temperature=0.0, num_slots=2)
  params = engine.place_params(init_params(CFG, jax.random.PRNGKey(5)))
  prompts = [_prompt("1+1="), _prompt("abcd"), _prompt("z")]
  stats = StaticStats()
  res = static_generate(engine, params, prompts, [3, 7, 5], stop_on_eos=False, stats=stats)
  assert [len(r.tokens) for r in res] == [3, 7, 5]
  assert stats.steps == (7 - 1) + (5 - 1)  # lockstep: each batch runs to its longest
  for p, r in zip(prompts, res):
    seq = np.concatenate([p, r.tokens])
    logp = _full_logp(params, seq)
    n = len(p)
    np.testing.assert_array_equal(r.tokens, logp[n - 1:len(seq) - 1].argmax(-1))
    np.testing.assert_allclose(r.logprobs, logp[np.arange(n - 1, len(seq) - 1), seq[n:]], atol=1e-4)


def test_warmup_compiles_multi_version_decode_ahead_of_time():
  """After ``warmup`` neither prefill buckets nor 1..K live versions compile."""
  from _compiles import count_compiles  # pylint: disable=g-import-not-at-top

  engine = DoraEngine(CFG, TOK, num_slots=2, max_prefill_length=16, temperature=1.0, seed=3,
                      devices=jax.devices()[-1:])
  engine.warmup(max_versions=3)
  params = engine.place_params(init_params(CFG, jax.random.PRNGKey(0)))
  state = engine.init_decode_state()
  with count_compiles() as seen:
    for slot, n in ((0, 5), (1, 20)):  # two prefill buckets (16 and 32)
      padded, true_len = engine.pad_tokens(np.full((n,), 5, np.int32))
      state, _, _ = engine.prefill_insert(params, 1, padded, true_len, state, slot)
    for live in ((1,), (1, 2), (1, 2, 3)):
      mv = MultiVersionParams({v: params for v in live}, live)
      state, res = engine.generate(mv, state)
      res.convert_to_numpy()
    state = engine.free_slot(state, 0)
    jax.block_until_ready(state)
  assert seen == [], f"{len(seen)} compile(s) after warmup"


def _assert_pinned_decode_matches_full_forward(params_by_version, pinned, prompts, steps):
  """Prefills ``prompts[slot]`` on version ``pinned[slot]``, decodes every live
  version together (greedy) and checks each slot's tokens and log-probs
  against its own version's full forward."""
  engine = _engine(temperature=0.0)
  ps = {v: engine.place_params(p) for v, p in params_by_version.items()}
  mv = MultiVersionParams(ps, tuple(sorted(ps)))
  state = engine.init_decode_state()
  first = {}
  for slot, version in pinned.items():
    padded, n = engine.pad_tokens(prompts[slot])
    prefix = engine.prefill(params=ps[version], version=version, padded_tokens=padded, true_length=n)
    first[slot] = int(prefix.token)
    state = engine.insert(prefix, state, slot)
  toks = {s: [] for s in pinned}
  lps = {s: [] for s in pinned}
  for _ in range(steps):
    state, res = engine.generate(mv, state)
    res = res.convert_to_numpy()
    for s in pinned:
      toks[s].append(int(res.data[s, 0]))
      lps[s].append(float(res.logprobs[s, 0]))
  # The first token came from prefill: the decode steps continue prompt + first.
  contexts = {s: np.concatenate([prompts[s], [first[s]]]) for s in pinned}
  _assert_matches_full_forward(contexts, pinned, ps, toks, lps)


def test_multi_version_mixes_full_and_compacted_passes_exactly():
  """Version 1 holds 3 of 4 slots (more than the largest gathered bucket, 2: a
  full pass), version 2 one (a gathered single-row pass); then 2 + 1 + 1 slots
  over three versions: tokens and log-probs match the full forward."""
  params = {v: init_params(CFG, jax.random.PRNGKey(19 + v)) for v in (1, 2)}
  prompts = {0: _prompt("abc"), 1: _prompt("12+7="), 2: _prompt("sort 31:"), 3: _prompt("rev xyz:")}
  _assert_pinned_decode_matches_full_forward(params, {0: 1, 1: 1, 2: 1, 3: 2}, prompts, steps=6)


def test_three_versions_each_decode_their_gathered_rows_exactly():
  params = {v: init_params(CFG, jax.random.PRNGKey(30 + v)) for v in (1, 2, 3)}
  pinned = {0: 1, 1: 3, 2: 2, 3: 1}
  prompts = {slot: _prompt(f"{slot}+{v}=") for slot, v in pinned.items()}
  _assert_pinned_decode_matches_full_forward(params, pinned, prompts, steps=5)


def test_four_live_versions_each_decode_their_rows_exactly():
  params = {v: init_params(CFG, jax.random.PRNGKey(40 + v)) for v in (1, 2, 3, 4)}
  pinned = {0: 3, 1: 1, 2: 4, 3: 2}
  prompts = {slot: _prompt(f"{v}*{slot}=") for slot, v in pinned.items()}
  _assert_pinned_decode_matches_full_forward(params, pinned, prompts, steps=5)


def _batched_groups(engine, ps, steps):
  """Admits two GRPO-style groups and a long resumed-like context through
  :meth:`prefill_insert_batch_async` on two versions, then decodes both versions
  together. Returns ``(contexts, pins, tokens, logprobs, work)`` per slot."""
  p1, p2 = _prompt("12+34="), _prompt("sort: c a b")
  long_ctx = _prompt("a longer context: 0123456789 abc")  # a second length bucket
  contexts = {0: p1, 1: p1, 2: p1, 3: long_ctx, 4: p2, 5: p2}
  pins = {0: 1, 1: 1, 2: 1, 3: 1, 4: 2, 5: 2}
  state = engine.init_decode_state()
  firsts, works = {}, []
  for v in (1, 2):
    slots = [s for s in contexts if pins[s] == v]
    state, out, work = engine.prefill_insert_batch_async(
        ps[v], v, [contexts[s] for s in slots], slots, state)
    works.append(work)
    for s, first in zip(slots, out):
      firsts[s] = np.asarray(first.values)[first.row]
  toks = {s: [int(firsts[s][0])] for s in contexts}
  lps = {s: [float(firsts[s][1])] for s in contexts}
  mv = MultiVersionParams(ps, (1, 2))
  for _ in range(steps):
    state, res = engine.generate(mv, state)
    res = res.convert_to_numpy()
    for s in contexts:
      toks[s].append(int(res.data[s, 0]))
      lps[s].append(float(res.logprobs[s, 0]))
  return contexts, pins, toks, lps, works


def _assert_matches_full_forward(contexts, pins, ps, toks, lps):
  for s, ctx in contexts.items():
    seq = np.concatenate([ctx, toks[s]]).astype(np.int32)
    logp = _full_logp(ps[pins[s]], seq)
    n = len(ctx)
    np.testing.assert_array_equal(toks[s], logp[n - 1:len(seq) - 1].argmax(-1))
    np.testing.assert_allclose(lps[s], logp[np.arange(n - 1, len(seq) - 1), seq[n:]], atol=1e-4)


def test_batched_shared_prefill_then_decode_matches_full_forward():
  """Groups sharing a prompt are prefilled once (the work counts say so), every
  member's tokens and log-probs equal its own version's full forward pass."""
  engine = _engine(temperature=0.0, num_slots=6)
  ps = {v: engine.place_params(init_params(CFG, jax.random.PRNGKey(50 + v))) for v in (1, 2)}
  contexts, pins, toks, lps, works = _batched_groups(engine, ps, steps=6)
  v1, v2 = works
  # Version 1: three members of one group + one other context -> two computed.
  assert v1.requests == 4 and v1.computed_tokens == len(contexts[0]) + len(contexts[3])
  assert v1.requested_tokens == 3 * len(contexts[0]) + len(contexts[3])
  assert v1.calls == 2  # two length buckets
  assert v2.requests == 2 and v2.computed_tokens == len(contexts[4]) and v2.calls == 1
  _assert_matches_full_forward(contexts, pins, ps, toks, lps)


def test_shared_prefill_members_sample_their_own_tokens():
  """At temperature 1 the members of a shared-prompt group draw independent
  first tokens (own keys), and their log-probs still match the full forward."""
  engine = _engine(temperature=1.0, num_slots=6, seed=7)
  ps = {v: engine.place_params(init_params(CFG, jax.random.PRNGKey(60 + v))) for v in (1, 2)}
  contexts, pins, toks, lps, _ = _batched_groups(engine, ps, steps=4)
  group = [tuple(toks[s]) for s in (0, 1, 2)]
  assert len(set(group)) > 1, group
  for s, ctx in contexts.items():
    seq = np.concatenate([ctx, toks[s]]).astype(np.int32)
    logp = _full_logp(ps[pins[s]], seq)
    n = len(ctx)
    np.testing.assert_allclose(lps[s], logp[np.arange(n - 1, len(seq) - 1), seq[n:]], atol=1e-4)


def test_dense_attention_without_sharing_prefills_every_member_and_stays_exact():
  """The previous decode path (whole-cache attention, whole-row gathers) with
  sharing off: every member is computed, and the result is as exact."""
  engine = _engine(temperature=0.0, num_slots=6, share_prompt_prefill=False,
                   decode_attention="dense")
  ps = {v: engine.place_params(init_params(CFG, jax.random.PRNGKey(50 + v))) for v in (1, 2)}
  contexts, pins, toks, lps, works = _batched_groups(engine, ps, steps=4)
  assert works[0].computed_tokens == works[0].requested_tokens == 3 * len(contexts[0]) + len(contexts[3])
  assert toks[0] == toks[1] == toks[2]  # greedy: same prompt, same tokens either way
  _assert_matches_full_forward(contexts, pins, ps, toks, lps)


def test_bf16_model_keeps_a_bf16_cache():
  cfg = dataclasses.replace(CFG, dtype="bfloat16", param_dtype="bfloat16")
  engine = DoraEngine(cfg, TOK, num_slots=2, max_prefill_length=16, temperature=0.0)
  state = engine.init_decode_state()
  assert state.cache.k.dtype == jnp.bfloat16 and state.cache.v.dtype == jnp.bfloat16
  params = engine.place_params(init_params(cfg, jax.random.PRNGKey(0)))
  padded, n = engine.pad_tokens(_prompt("abc"))
  state, _, _ = engine.prefill_insert(params, 0, padded, n, state, 0)
  state, res = engine.generate(MultiVersionParams.single(0, params), state)
  assert state.cache.k.dtype == jnp.bfloat16
  assert np.isfinite(res.convert_to_numpy().logprobs[0, 0])


def _primitives(jaxpr) -> set[str]:
  """Every primitive name in ``jaxpr`` and the jaxprs nested in its equations."""
  names = set()
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    for sub in jax.core.jaxprs_in_params(eqn.params):
      names |= _primitives(sub)
  return names


def test_decode_programs_have_no_data_dependent_loops_or_branches():
  """Issue 23: on a GPU a ``while`` whose trip count lives on the device, or a
  ``cond``, copies a predicate to the host and waits on it (and breaks
  command-buffer capture). Every decode program, single-version and each
  multi-version pass shape, at every length bucket, has neither; the host
  picks the static bound and row counts (DecodeHint)."""
  engine = _engine(temperature=1.0, top_p=0.9, length_buckets=(16, 32))
  assert engine.length_buckets == (16, 32, 48)
  params = engine.place_params(init_params(CFG, jax.random.PRNGKey(0)))
  state = engine.init_decode_state()
  programs = engine.programs.decode_traces(params, state, version=1)
  # 3 lengths x (the fused program + 3 pass sizes: 1, 2 and all 4 slots), and the commit.
  assert len(programs) == 3 * (1 + 3) + 1
  for traced in programs:
    names = _primitives(traced.jaxpr.jaxpr)
    assert "dot_general" in names or "scatter" in names  # the walk sees the program
    assert not names & {"while", "cond"}, sorted(names & {"while", "cond"})


def test_a_wrong_decode_hint_is_reported_not_silently_used():
  """A hint below a slot's position (its cache entries past the bound would
  go unread) or below a version's row count is flagged in the result."""
  from jax_dora.rollout.engine import DecodeHint  # pylint: disable=g-import-not-at-top

  engine = _engine(temperature=0.0, length_buckets=(16, 32))
  pa = engine.place_params(init_params(CFG, jax.random.PRNGKey(1)))
  pb = engine.place_params(init_params(CFG, jax.random.PRNGKey(2)))
  state = engine.init_decode_state()
  long_prompt = np.full((20,), 5, np.int32)  # position 20: the 32-entry bucket
  state, _, _ = engine.prefill_insert(pa, 1, *engine.pad_tokens(long_prompt), state, 0)
  state, _, _ = engine.prefill_insert(pb, 2, *engine.pad_tokens(_prompt("ab")), state, 1)
  state, _, _ = engine.prefill_insert(pb, 2, *engine.pad_tokens(_prompt("cd")), state, 2)
  one = MultiVersionParams.single(1, pa)
  both = MultiVersionParams({1: pa, 2: pb}, (1, 2))
  assert engine.decode_hint(state, (1, 2)) == DecodeHint(20, {1: 1, 2: 2})
  cases = [
      (both, DecodeHint(20, {1: 1, 2: 2}), False),
      (both, DecodeHint(16, {1: 1, 2: 2}), True),   # position 20 > bound 16
      (both, DecodeHint(22, {1: 1, 2: 1}), True),   # version 2 has 2 rows, a 1-row pass
      (one, DecodeHint(16, {1: 1}), True),
  ]
  for params, hint, violated in cases:
    state, res = engine.generate(params, state, hint)
    assert bool(res.convert_to_numpy().hint_violated) == violated, hint


def test_scanned_layers_engine_matches_unrolled(tmp_path):
  """``scan_layers``: prefill and decode loop over one compiled block over
  stacked params; the tokens and log-probs are the unrolled engine's (single
  version, a full pass and a gathered-rows pass of two live versions, heads
  split over two devices), and snapshots, which keep the per-layer layout,
  load stacked."""
  from jax_dora.model import unstack_layers  # pylint: disable=g-import-not-at-top
  from jax_dora.snapshots import SnapshotPublisher, SnapshotReader  # pylint: disable=g-import-not-at-top

  raw = {v: init_params(CFG, jax.random.PRNGKey(20 + v)) for v in (1, 2)}
  outs = {}
  for scan in (False, True):
    engine = _engine(temperature=0.0, scan_layers=scan, devices=jax.devices()[6:8], tensor_parallel=2)
    ps = {v: engine.place_params(p) for v, p in raw.items()}
    if scan:
      assert "layers" in ps[1] and "layers_0" not in ps[1]
      assert ps[1]["layers"]["mlp"]["wo"]["kernel"].shape == (CFG.n_layers, CFG.d_ff, CFG.d_model)
      jax.tree.map(np.testing.assert_array_equal, unstack_layers(ps[1]), raw[1])
    single = _run(engine, ps[1], [_prompt("12+34="), _prompt("sort: c a b")], (0, 3), steps=6)
    state = engine.init_decode_state()
    for slot, version in ((0, 1), (1, 1), (2, 2), (3, 1)):  # v1: a full pass; v2: one gathered row
      state, _, _ = engine.prefill_insert(ps[version], version, *engine.pad_tokens(_prompt(f"{slot}+1=")),
                                          state, slot)
    both = MultiVersionParams(ps, (1, 2))
    steps = []
    for _ in range(4):
      state, res = engine.generate(both, state)
      res = res.convert_to_numpy()
      steps.append([(int(res.get_result_at_slot(s).tokens[0, 0]), float(res.get_logprobs_at_slot(s)[0]))
                    for s in range(4)])
    outs[scan] = (single, steps)
  (single_u, steps_u), (single_s, steps_s) = outs[False], outs[True]
  for i in single_u:
    assert single_s[i][0] == single_u[i][0]
    np.testing.assert_allclose(single_s[i][1], single_u[i][1], atol=1e-5)
  assert [[t for t, _ in row] for row in steps_s] == [[t for t, _ in row] for row in steps_u]
  np.testing.assert_allclose([[lp for _, lp in row] for row in steps_s],
                             [[lp for _, lp in row] for row in steps_u], atol=1e-5)
  publisher = SnapshotPublisher(tmp_path / "snaps", max_to_keep=None)
  publisher.publish(1, raw[1])
  publisher.close()
  loaded = engine.load_params(SnapshotReader(str(tmp_path / "snaps")), 1)
  jax.tree.map(np.testing.assert_array_equal, loaded, engine.place_params(raw[1]))
  # Embedded servers share one load: a stacked tree places as it is.
  jax.tree.map(np.testing.assert_array_equal, engine.place_params(loaded), loaded)
