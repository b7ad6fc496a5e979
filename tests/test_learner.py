"""Learner: batching, sharded == unsharded step, micro-batches and PPO minibatches.

The loss maths on hand-computed cases is in test_losses.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dora.config import base_config
from jax_dora.learner.batching import make_batch
from jax_dora.learner.losses import compute_advantages
from jax_dora.learner.mesh import make_mesh, split_devices
from jax_dora.learner.train_state import Learner
from jax_dora.model import ModelConfig
from jax_dora.types import Prompt, TokenSpan, Trajectory


def group_advantages(rewards, group_size):
  return compute_advantages("grpo", rewards, group_size)


def _traj(sample_id, member, prompt_tokens, completion, logps):
  return Trajectory(
      sample_id=sample_id, member=member,
      prompt=Prompt(sample_id, "t", "x", "y"),
      prompt_tokens=np.asarray(prompt_tokens, np.int32),
      completion_tokens=np.asarray(completion, np.int32),
      behaviour_logprobs=np.asarray(logps, np.float32),
      spans=[TokenSpan(0, len(completion), 0)], finish_reason="eos", reward=0.0,
  )


def test_make_batch_aligns_targets_mask_and_logprobs():
  t = _traj(0, 0, [1, 5, 6], [7, 2], [-0.1, -0.2])
  b = make_batch([t], np.array([0.5]), seq_len=8)
  assert b["inputs"].shape == (1, 7)
  # Completion token 7 is at position 3, predicted from input position 2.
  assert b["targets"][0, 2] == 7 and b["targets"][0, 3] == 2
  np.testing.assert_array_equal(b["mask"][0], [0, 0, 1, 1, 0, 0, 0])
  np.testing.assert_allclose(b["behaviour_logprobs"][0, 2:4], [-0.1, -0.2])
  with pytest.raises(ValueError, match="exceed"):
    make_batch([_traj(0, 0, [1] * 6, [3, 3, 3], [0, 0, 0])], np.zeros(1), seq_len=8)


def _random_batch(rng, model_cfg, batch):
  trajs = []
  for i in range(batch):
    p = rng.integers(3, model_cfg.vocab_size, size=rng.integers(3, 8))
    c = rng.integers(3, model_cfg.vocab_size, size=rng.integers(1, 10))
    trajs.append(_traj(i // 2, i % 2, np.concatenate([[1], p]), c, -rng.random(len(c)) * 3))
  adv = group_advantages(rng.random(batch), group_size=2)
  return make_batch(trajs, adv, model_cfg.max_seq_len)


def test_sharded_step_matches_unsharded():
  """8-device (data=2, fsdp=2, tensor=2) mesh gives the same loss as 1 device."""
  assert len(jax.devices()) == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
  cfg = base_config()
  cfg.learner.warmup_steps = 1
  model_cfg = ModelConfig(vocab_size=48, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=24)
  batch = _random_batch(np.random.default_rng(0), model_cfg, 8)

  single = Learner(model_cfg, cfg.learner, make_mesh(jax.devices()[:1]), seed=3)
  sharded = Learner(model_cfg, cfg.learner, make_mesh(jax.devices(), 2, 2, 2), seed=3)
  kernel = jax.tree.leaves(sharded.params)
  assert any(len(x.sharding.device_set) == 8 and not x.sharding.is_fully_replicated for x in kernel)

  losses = []
  for learner in (single, sharded):
    m1 = learner.train_step(batch)
    m2 = learner.train_step(batch)
    losses.append((m1["loss"], m2["loss"], m1["grad_norm"]))
  np.testing.assert_allclose(losses[0], losses[1], rtol=2e-4, atol=1e-5)
  # The update actually changed the policy (the second loss differs).
  assert losses[0][0] != losses[0][1]


def test_split_devices_disjoint():
  learner, rollout = split_devices(-1, 2)
  assert len(learner) == 6 and len(rollout) == 2
  assert not set(learner) & set(rollout)
  with pytest.raises(ValueError):
    split_devices(-1, 8)


def test_bucket_length_picks_smallest_fitting_bucket():
  from jax_dora.learner.batching import bucket_length, parse_buckets  # pylint: disable=g-import-not-at-top

  buckets = parse_buckets("64, 48,200", 96)
  assert buckets == (48, 64, 96)
  short = [_traj(0, 0, [1] * 20, [3] * 10, [0.0] * 10)]
  long = short + [_traj(0, 1, [1] * 20, [3] * 50, [0.0] * 50)]
  assert bucket_length(short, buckets) == 48
  assert bucket_length(long, buckets) == 96
  assert parse_buckets("", 96) == (96,)
  with pytest.raises(ValueError):
    parse_buckets("1", 96)


def test_warmup_compiles_every_length_bucket_ahead_of_time():
  """After ``warmup`` no train step on a bucketed shape compiles (no mid-run stalls)."""
  from _compiles import count_compiles  # pylint: disable=g-import-not-at-top

  cfg = base_config()
  model_cfg = ModelConfig(vocab_size=48, d_model=32, n_layers=1, n_heads=2, d_ff=64, max_seq_len=24)
  learner = Learner(model_cfg, cfg.learner, make_mesh(jax.devices()[:2]), seed=5)
  rng = np.random.default_rng(1)
  with count_compiles() as before:
    learner.warmup(4, (16, 24))
  assert len(before) == 2  # one executable per bucket
  for seq_len in (16, 24):
    trajs = [_traj(i // 2, i % 2, [1, 5, 6], rng.integers(3, 48, size=4), [-1.0] * 4)
             for i in range(4)]
    batch = make_batch(trajs, group_advantages(rng.random(4), 2), seq_len)
    with count_compiles() as seen:
      learner.train_step(batch)
    assert seen == [], f"train step on [4, {seq_len}] compiled after warmup"


def test_logprobs_suppress_ids_and_temperature_hand_computed():
  """hidden @ head with id 3 suppressed at temperature 2, by hand:
  row 0 logits [1, 0, 0, 5] -> scaled [0.5, 0, 0] -> log p(0) = 0.5 - log(e^0.5 + 2)
  row 1 logits [0, 2, 0, 5] -> scaled [0, 1, 0]   -> log p(1) = 1 - log(e + 2)."""
  from jax_dora.model import chunked_token_logprobs, suppress_mask, token_logprobs

  hidden = jnp.array([[[1.0, 0.0], [0.0, 1.0]]])
  head = jnp.array([[1.0, 0.0, 0.0, 5.0], [0.0, 2.0, 0.0, 5.0]])
  mask = suppress_mask(4, [3])
  out = chunked_token_logprobs(hidden, head, jnp.array([[0, 1]]), temperature=2.0, mask=mask)
  np.testing.assert_allclose(out, [[-0.7943767, -0.5514447]], atol=1e-6)
  same = token_logprobs(hidden @ head, jnp.array([[0, 1]]), temperature=2.0, mask=mask)
  np.testing.assert_allclose(same, out, atol=1e-6)


def test_chunked_logprobs_and_grads_equal_the_full_logits_path():
  from jax_dora.model import chunked_token_logprobs, suppress_mask

  rng = np.random.default_rng(0)
  hidden = jnp.asarray(rng.normal(size=(3, 37, 16)), jnp.float32)
  head = jnp.asarray(rng.normal(size=(16, 50)), jnp.float32)
  targets = jnp.asarray(rng.integers(2, 50, size=(3, 37)))
  mask = suppress_mask(50, [0, 1])

  def total(h, w, chunk):
    return chunked_token_logprobs(h, w, targets, temperature=0.7, mask=mask, chunk=chunk).sum()

  full, g_full = jax.value_and_grad(total, argnums=(0, 1))(hidden, head, 0)
  for chunk in (8, 16, 36):  # uneven tails included
    val, g = jax.value_and_grad(total, argnums=(0, 1))(hidden, head, chunk)
    np.testing.assert_allclose(val, full, rtol=1e-5)
    np.testing.assert_allclose(g[0], g_full[0], atol=1e-4)
    np.testing.assert_allclose(g[1], g_full[1], atol=1e-4)


def _assert_same_params(got, want, updates: int = 1) -> None:
  """Parameters after ``updates`` Adam steps that should be the same update.

  Adam divides each gradient element by its own running RMS, so an element
  whose gradient is near zero turns summation-order rounding (another
  micro-batch split, another CPU's vector width: this failed at 1.04e-5 on an
  AMD EPYC machine with a 1e-5 tolerance) into an update difference that is a
  visible share of the learning rate. What the same update promises is
  every element within 1% of the learning rate per update: a dropped or
  mis-weighted micro-batch turns gradient directions and moves elements by a
  large share of the rate. (A batch-wide normaliser error, which Adam's
  scale invariance hides here, is what the loss and grad_norm checks catch.)
  """
  atol = 0.01 * base_config().learner.learning_rate * updates
  for x, y in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=atol)


@pytest.mark.parametrize("overrides", [
    {"micro_batch_size": 2},
    # Also with a loss whose normalisers (sequences) and metrics (max/min
    # weights) do not simply add up over micro-batches.
    {"micro_batch_size": 4, "logprob_chunk_size": 5, "remat": "full", "loss": "decoupled_ppo",
     "is_correction": "tis", "tis_cap": 1.1, "loss_aggregation": "seq_mean_token_mean"},
])
def test_micro_batched_chunked_remat_step_equals_plain_step(overrides):
  """Gradient accumulation over micro-batches (token-mean over the whole batch),
  chunked log-probs and remat change memory, not the update."""
  cfg = base_config()
  cfg.learner.warmup_steps = 1
  model_cfg = ModelConfig(vocab_size=48, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                          d_ff=64, max_seq_len=24)
  batch = _random_batch(np.random.default_rng(2), model_cfg, 8)
  plain_cfg = cfg.learner.copy_and_resolve_references()
  plain_cfg.update({k: v for k, v in overrides.items()
                    if k not in ("micro_batch_size", "logprob_chunk_size", "remat")})
  plain_cfg.logprob_chunk_size = 0
  plain = Learner(model_cfg, plain_cfg, make_mesh(jax.devices()[:2]), seed=7)
  tuned_cfg = cfg.learner.copy_and_resolve_references()
  tuned_cfg.update(overrides)
  tuned = Learner(model_cfg, tuned_cfg, make_mesh(jax.devices()[:2]), seed=7)
  a, b = plain.train_step(batch), tuned.train_step(batch)
  for k in ("loss", "grad_norm", "pg_loss", "clip_frac", "ratio_mean", "is_weight_max",
            "is_weight_min", "mismatch/kl_k3"):
    np.testing.assert_allclose(b[k], a[k], rtol=1e-4, atol=1e-6, err_msg=k)
  _assert_same_params(tuned.params, plain.params)


def _tiny_learner(**learner_overrides):
  cfg = base_config()
  cfg.learner.warmup_steps = 1
  cfg.learner.update(learner_overrides)
  model_cfg = ModelConfig(vocab_size=48, d_model=32, n_layers=1, n_heads=2, d_ff=64, max_seq_len=24)
  return Learner(model_cfg, cfg.learner, make_mesh(jax.devices()[:2]), seed=11), model_cfg


def test_ppo_minibatches_are_sequential_updates_on_interleaved_rows():
  """ppo_minibatches=2 (grpo, nothing proximal) == two plain steps on rows 0::2 and 1::2."""
  two, model_cfg = _tiny_learner(ppo_minibatches=2)
  seq, _ = _tiny_learner()
  batch = _random_batch(np.random.default_rng(4), model_cfg, 8)
  two.train_step(batch)
  for i in (0, 1):
    seq.train_step({k: v[i::2] for k, v in batch.items()})
  assert two.step == 1 and seq.step == 2  # one version, two optimizer updates
  _assert_same_params(two.params, seq.params, updates=2)


def test_decoupled_ppo_recomputes_proximal_from_the_current_version():
  """On-policy data (behaviour = the learner's own log-probs): with the proximal
  policy recomputed before the first of two updates, decoupled PPO equals GRPO,
  while after the first update its ratios differ from 1 (so the recompute
  is what keeps them equal, not a no-op)."""
  grpo, model_cfg = _tiny_learner(ppo_minibatches=2)
  dec, _ = _tiny_learner(ppo_minibatches=2, loss="decoupled_ppo")
  batch = _random_batch(np.random.default_rng(6), model_cfg, 8)
  on_policy = jax.jit(grpo._token_logprobs)(grpo.params, grpo.put_batch(batch))
  batch["behaviour_logprobs"] = np.asarray(on_policy) * batch["mask"]
  a, b = grpo.train_step(batch), dec.train_step(batch)
  assert abs(a["ratio_mean"] - 1.0) > 1e-6  # the second minibatch ran off the first's update
  for k in ("loss", "grad_norm", "ratio_mean"):
    np.testing.assert_allclose(b[k], a[k], rtol=1e-4, atol=1e-6, err_msg=k)
  _assert_same_params(dec.params, grpo.params, updates=2)


def test_make_batch_token_staleness_and_truncated_rows():
  t = _traj(0, 0, [1, 5], [7, 8, 9], [-0.1, -0.2, -0.3])
  t.spans = [TokenSpan(0, 2, 3), TokenSpan(2, 3, 5)]
  cut = _traj(0, 1, [1, 5], [7, 8], [-0.1, -0.2])
  cut.finish_reason = "length"
  b = make_batch([t, cut], np.zeros(2), seq_len=8, learner_version=6, mask_truncated=True)
  np.testing.assert_array_equal(b["token_staleness"][0], [0, 3, 3, 1, 0, 0, 0])
  np.testing.assert_array_equal(b["mask"][1], np.zeros(7))  # truncated: no gradient
  np.testing.assert_array_equal(b["mask"][0], [0, 1, 1, 1, 0, 0, 0])


def test_length_groups_sort_rows_and_pick_each_micro_batch_its_bucket():
  """Rows needing 10, 2, 0, 5, 23, 3 positions (by hand: one past the last
  trained target), 2 rows per micro-batch, buckets 8/16/24 -> 7/15/23 positions:
  sorted {2, 1} -> 7, {5, 3} -> 7, {0, 4} -> 23 (row 4 needs all 23)."""
  from jax_dora.learner.length_groups import (
    needed_positions,
    plan_micro_batches,
    take_micro_batch,
  )

  mask = np.zeros((6, 23), np.float32)
  for row, (start, stop) in enumerate([(4, 10), (0, 2), (0, 0), (3, 5), (20, 23), (1, 3)]):
    mask[row, start:stop] = 1.0
  mask[0, 6] = 0.0  # a hole inside a row does not shorten it
  np.testing.assert_array_equal(needed_positions(mask), [10, 2, 0, 5, 23, 3])
  plan = plan_micro_batches(mask, 2, (8, 16, 24))
  assert [(m.rows.tolist(), m.positions) for m in plan] == [([1, 2], 7), ([3, 5], 7), ([0, 4], 23)]
  # Buckets above the batch's own length are capped at it.
  assert plan_micro_batches(mask[:, :12][[1, 2]], 2, (8, 16))[0].positions == 7
  assert plan_micro_batches(mask[:, :12], 3, (16, 24))[-1].positions == 12
  cut = take_micro_batch({"mask": mask, "advantages": np.arange(6.0)}, plan[1])
  assert cut["mask"].shape == (2, 7) and cut["advantages"].tolist() == [3.0, 5.0]
  with pytest.raises(ValueError, match="multiple of micro_batch_size"):
    plan_micro_batches(mask, 4, (8,))


def _long_tailed_batch(rng, model_cfg, batch):
  """Prompts of 3-4 tokens and answers of 1-4 (at most 7 positions), except one
  answer of 16 (a long tail: up to 19 positions)."""
  trajs = []
  for i in range(batch):
    p = rng.integers(3, model_cfg.vocab_size, size=rng.integers(2, 4))
    c = rng.integers(3, model_cfg.vocab_size, size=16 if i == 5 else rng.integers(1, 5))
    trajs.append(_traj(i // 2, i % 2, np.concatenate([[1], p]), c, -rng.random(len(c)) * 3))
  adv = group_advantages(rng.random(batch), group_size=2)
  return make_batch(trajs, adv, model_cfg.max_seq_len)


def test_length_grouped_micro_batches_equal_the_fused_step():
  """Two steps with micro-batches cut by length and padded to their own bucket
  give the fused step's losses, metrics and parameters, computing fewer
  positions, and compile nothing after ``warmup``. With normalisers over
  sequences, max/min metrics, a KL reference, and two minibatch updates whose
  proximal policy is recomputed micro-batch by micro-batch (the plain grpo,
  one-update case runs in test_multiprocess's two-learner run)."""
  from _compiles import count_compiles  # pylint: disable=g-import-not-at-top

  cfg = base_config()
  cfg.learner.update(warmup_steps=1, seq_len_buckets="8", loss="decoupled_ppo",
                     is_correction="tis", tis_cap=1.1, kl_coef=0.05,
                     loss_aggregation="seq_mean_token_mean", ppo_minibatches=2)
  model_cfg = ModelConfig(vocab_size=48, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                          d_ff=64, max_seq_len=24)
  mesh = make_mesh(jax.devices()[:2])
  fused = Learner(model_cfg, cfg.learner, mesh, seed=7)
  grouped_cfg = cfg.learner.copy_and_resolve_references()
  grouped_cfg.update(micro_batch_size=2, group_micro_batches_by_length=True)
  grouped = Learner(model_cfg, grouped_cfg, mesh, seed=7)
  grouped.warmup(8, (8, 24))
  rng = np.random.default_rng(3)
  for _ in range(2):
    batch = _long_tailed_batch(rng, model_cfg, 8)
    a = fused.train_step(batch)
    with count_compiles() as compiled:
      b = grouped.train_step(batch)
    assert compiled == [], "length-grouped train step compiled after warmup"
    for k in ("loss", "grad_norm", "pg_loss", "clip_frac", "ratio_mean", "is_weight_max",
              "is_weight_min", "kl", "mismatch/kl_k3"):
      np.testing.assert_allclose(b[k], a[k], rtol=1e-4, atol=1e-6, err_msg=k)
    assert a["positions_computed"] == 8 * 23
    # Per minibatch of 4 rows: 3 short rows and the long one -> one pair at
    # 7 positions and one at 23 (the long row's minibatch), or two pairs at 7.
    assert b["positions_computed"] == 2 * 7 + 2 * 23 + 2 * 7 + 2 * 7
  assert grouped.step == fused.step == 2
  _assert_same_params(grouped.params, fused.params, updates=4)
  with pytest.raises(ValueError, match="multiple of the 2 data x fsdp"):
    grouped_cfg.micro_batch_size = 1
    Learner(model_cfg, grouped_cfg, mesh, seed=5)


def test_a_detached_copy_is_cast_in_the_same_copy_and_owns_its_buffers():
  """What a background publish reads: ``detached_params(version, "bfloat16")`` is the
  learner's params rounded to bfloat16 (ml_dtypes' numpy cast is the oracle), on the same
  shardings, in new buffers (the next, donating, step cannot clobber it); without a dtype it
  is the float32 bytes themselves."""
  import ml_dtypes  # pylint: disable=g-import-not-at-top

  cfg = base_config()
  model_cfg = ModelConfig(vocab_size=48, d_model=32, n_layers=1, n_heads=4, d_ff=64,
                          max_seq_len=24)
  learner = Learner(model_cfg, cfg.learner, make_mesh(jax.devices()[:4], 1, 2, 2), seed=3)
  params = jax.tree.leaves(learner.params)
  for dtype, want in ((None, np.float32), ("bfloat16", ml_dtypes.bfloat16)):
    copy = jax.tree.leaves(learner.detached_params(7, dtype))
    for got, src in zip(copy, params):
      assert got.sharding.is_equivalent_to(src.sharding, src.ndim)
      assert all(a.data.unsafe_buffer_pointer() != b.data.unsafe_buffer_pointer()
                 for a, b in zip(got.addressable_shards, src.addressable_shards))
      host = np.asarray(jax.device_get(got))
      assert host.dtype == want
      assert host.tobytes() == np.asarray(jax.device_get(src)).astype(want).tobytes()
