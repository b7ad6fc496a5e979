"""Loss registry: every objective, correction, aggregation and estimator on
small cases whose expected values are worked out by hand below (not with the
code under test)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dora.learner.losses import (
    ADVANTAGES,
    LossSettings,
    compute_advantages,
    loglinear_proximal,
    policy_loss,
)
from jax_dora.learner.losses.aggregation import BatchTotals
from jax_dora.rewards.overlong import overlong_penalty

# Three rows of three positions; the last position of every row (and the
# second of row 2) is padding with a wild ratio that must not leak in.
#            pi              pi_behaviour       pi_prox
PI = [[0.5, 0.25, 0.9], [0.5, 0.1, 0.9], [0.75, 0.1, 0.9]]
PB = [[0.5, 0.5, 0.01], [0.25, 0.2, 0.01], [0.5, 0.2, 0.01]]
PP = [[0.25, 0.5, 0.01], [0.5, 0.2, 0.01], [0.75, 0.2, 0.01]]
MASK = [[1, 1, 0], [1, 1, 0], [1, 0, 0]]
ADV = [1.0, -1.0, 0.5]
# pi / pi_b = [[1, .5], [2, .5], [1.5]];  rho = pi_prox / pi_b = [[.5, 1], [2, 1], [1.5]]
# pi / pi_prox = [[2, .5], [1, .5], [1]]


def _run(settings: LossSettings, prox=True, **kw):
  logp = jnp.log(jnp.asarray(PI))
  return policy_loss(
      logp, jnp.log(jnp.asarray(PB)), jnp.asarray(ADV), jnp.asarray(MASK, jnp.float32), settings,
      proximal_logprobs=jnp.log(jnp.asarray(PP)) if prox else None, **kw)


S = LossSettings(clip_eps=0.2, clip_eps_high=0.28)


def test_grpo_token_mean_and_clip_fractions_by_side():
  # per token -min(rA, clip(r, .8, 1.28)A):
  #   row0: r=1 -> -1; r=.5, A>0 -> -.5 (unclipped side taken: not a clip)
  #   row1: r=2, A<0 -> 2 (unclipped); r=.5, A<0 -> .8 (LOW bound active)
  #   row2: r=1.5, A=.5 -> -min(.75, .64) = -.64 (HIGH bound active)
  out = _run(S)
  assert float(out.loss) == pytest.approx((-1 - 0.5 + 2 + 0.8 - 0.64) / 5, abs=1e-6)
  m = out.metrics
  assert float(m["clip_frac_low"]) == pytest.approx(1 / 5, abs=1e-6)
  assert float(m["clip_frac_high"]) == pytest.approx(1 / 5, abs=1e-6)
  assert float(m["clip_frac"]) == pytest.approx(2 / 5, abs=1e-6)
  assert float(m["ratio_mean"]) == pytest.approx((1 + 0.5 + 2 + 0.5 + 1.5) / 5, abs=1e-6)
  assert float(m["pg_loss"]) == pytest.approx(float(out.loss), abs=1e-7)


@pytest.mark.parametrize("aggregation, expected", [
    ("token_mean", (-1.5 + 2.8 - 0.64) / 5),
    # Row means -.75, 1.4, -.64, then their mean.
    ("seq_mean_token_mean", (-0.75 + 1.4 - 0.64) / 3),
    # Token sums / (3 rows x norm_length 4).
    ("seq_mean_token_sum_norm", (-1.5 + 2.8 - 0.64) / 12),
])
def test_aggregations(aggregation, expected):
  s = dataclasses.replace(S, aggregation=aggregation, norm_length=4)
  assert float(_run(s).loss) == pytest.approx(expected, abs=1e-6)


def test_grpo_gradient_is_zero_where_the_clip_is_active():
  s = S
  logp = jnp.log(jnp.asarray(PI))

  def f(lp):
    return policy_loss(lp, jnp.log(jnp.asarray(PB)), jnp.asarray(ADV),
                       jnp.asarray(MASK, jnp.float32), s).loss

  g = np.asarray(jax.grad(f)(logp))
  # d/dlogp of -rA/5 = -rA/5 where unclipped; 0 where clipped or masked.
  np.testing.assert_allclose(g, [[-0.2, -0.1, 0], [0.4, 0.0, 0], [0.0, 0, 0]], atol=1e-6)


def test_decoupled_ppo_hand_computed():
  # r' = pi/pi_prox = [[2, .5], [1, .5], [1]], weight rho = [[.5, 1], [2, 1], [1.5]]
  #   row0: -min(2, 1.28) * .5 = -.64 (high clip); -.5 * 1
  #   row1: 1 * 2 = 2; .8 * 1 (low clip)
  #   row2: -.5 * 1.5 = -.75
  out = _run(dataclasses.replace(S, loss="decoupled_ppo"))
  assert float(out.loss) == pytest.approx((-0.64 - 0.5 + 2 + 0.8 - 0.75) / 5, abs=1e-6)
  assert float(out.metrics["is_weight_mean"]) == pytest.approx((0.5 + 1 + 2 + 1 + 1.5) / 5, abs=1e-6)
  assert float(out.metrics["is_weight_max"]) == pytest.approx(2.0, abs=1e-6)
  assert float(out.metrics["is_weight_min"]) == pytest.approx(0.5, abs=1e-6)


def test_decoupled_ppo_with_token_tis():
  # weights min(rho, 1.2) = [[.5, 1], [1.2, 1], [1.2]]: row1 t0 -> 1.2, row2 -> -.6
  out = _run(dataclasses.replace(S, loss="decoupled_ppo", correction="tis", tis_cap=1.2))
  assert float(out.loss) == pytest.approx((-0.64 - 0.5 + 1.2 + 0.8 - 0.6) / 5, abs=1e-6)
  assert float(out.metrics["is_truncated_frac"]) == pytest.approx(2 / 5, abs=1e-6)
  assert float(out.metrics["is_weight_max"]) == pytest.approx(1.2, abs=1e-6)
  assert float(out.metrics["is_weight_mean"]) == pytest.approx(4.9 / 5, abs=1e-6)


def test_decoupled_ppo_with_sequence_tis():
  # Geometric-mean rho per row: .7071 (kept), sqrt(2) -> capped at 1.2, 1.5 -> 1.2.
  # Row 1 weights scale by 1.2 / sqrt(2): [2, 1] * .848528; row 2 weight 1.2.
  f = 1.2 / math.sqrt(2)
  out = _run(dataclasses.replace(S, loss="decoupled_ppo", correction="tis", tis_cap=1.2,
                                 correction_level="sequence"))
  assert float(out.loss) == pytest.approx((-0.64 - 0.5 + 2 * f + 0.8 * f - 0.6) / 5, abs=1e-6)
  assert float(out.metrics["is_truncated_frac"]) == pytest.approx(3 / 5, abs=1e-6)


def test_masked_is_token_and_sequence():
  # Token: rho in [.6, 1.8] keeps row0 t1, row1 t1, row2 t0 (-.5, .8, -.75);
  # the normaliser stays the 5 trained tokens.
  tok = _run(dataclasses.replace(S, loss="decoupled_ppo", correction="mis", mis_low=0.6, mis_high=1.8))
  assert float(tok.loss) == pytest.approx((-0.5 + 0.8 - 0.75) / 5, abs=1e-6)
  assert float(tok.metrics["is_masked_frac"]) == pytest.approx(2 / 5, abs=1e-6)
  # Sequence (geometric mean .7071, 1.4142, 1.5) in [.8, 1.45]: only row 1 stays.
  seq = _run(dataclasses.replace(S, loss="decoupled_ppo", correction="mis", mis_low=0.8,
                                 mis_high=1.45, correction_level="sequence"))
  assert float(seq.loss) == pytest.approx((2 + 0.8) / 5, abs=1e-6)
  assert float(seq.metrics["is_masked_frac"]) == pytest.approx(3 / 5, abs=1e-6)


def test_grpo_with_tis_truncates_the_behaviour_part_of_the_ratio():
  # r = (pi/pi_b) * min(rho, 1.2)/rho = [[1, .5], [1.2, .5], [1.2]]
  #   -1, -.5, then A=-1 r=1.2 -> 1.2, .8, then A=.5 r=1.2 (< 1.28) -> -.6
  out = _run(dataclasses.replace(S, correction="tis", tis_cap=1.2))
  assert float(out.loss) == pytest.approx((-1 - 0.5 + 1.2 + 0.8 - 0.6) / 5, abs=1e-6)


def test_gspo_sequence_ratio():
  # Per-row ratio exp(mean log(pi/pi_b)): .7071, 1, 1.5; clip [.8, 1.28].
  #   row0 A=1: -min(.7071, .8) = -.7071 per token; row1 A=-1: 1; row2: -min(.75, .64)
  s = dataclasses.replace(S, loss="gspo", gspo_clip_eps=0.2, gspo_clip_eps_high=0.28,
                          aggregation="seq_mean_token_mean")
  out = _run(s)
  assert float(out.loss) == pytest.approx((-math.sqrt(0.5) + 1 - 0.64) / 3, abs=1e-6)
  assert float(out.metrics["clip_frac_high"]) == pytest.approx(1 / 5, abs=1e-6)


def test_cispo_value_and_detached_weight():
  # -min(r, 1.3) A log pi:  r = [[1, .5], [2, .5], [1.5]]
  lp = np.log(np.asarray(PI))
  per = [-1 * 1 * lp[0, 0], -0.5 * 1 * lp[0, 1], -1.3 * -1 * lp[1, 0], -0.5 * -1 * lp[1, 1],
         -1.3 * 0.5 * lp[2, 0]]
  s = dataclasses.replace(S, loss="cispo", cispo_clip_high=0.3)
  out = _run(s)
  assert float(out.loss) == pytest.approx(sum(per) / 5, abs=1e-6)
  assert float(out.metrics["clip_frac_high"]) == pytest.approx(2 / 5, abs=1e-6)

  def f(logp):
    return policy_loss(logp, jnp.log(jnp.asarray(PB)), jnp.asarray(ADV),
                       jnp.asarray(MASK, jnp.float32), s).loss

  # The weight is detached: d/dlog pi = -w A / 5, every token keeps a gradient.
  g = np.asarray(jax.grad(f)(jnp.log(jnp.asarray(PI))))
  np.testing.assert_allclose(g, [[-0.2, -0.1, 0], [0.26, 0.1, 0], [-0.13, 0, 0]], atol=1e-6)


def test_kl_term_is_added_and_reported_separately():
  # pi = [.5, .25], pi_ref = [.25, .25], pi_b = pi, A = 1: pg = -1;
  # k3(log pi_ref - log pi) = [.5 - 1 + log 2, 0] -> token mean .0965736.
  logp = jnp.log(jnp.array([[0.5, 0.25]]))
  ref = jnp.log(jnp.array([[0.25, 0.25]]))
  s = LossSettings(kl_coef=0.1)
  out = policy_loss(logp, logp, jnp.array([1.0]), jnp.ones((1, 2)), s, ref_logprobs=ref)
  kl = (0.5 - 1 + math.log(2)) / 2
  assert float(out.metrics["kl"]) == pytest.approx(kl, abs=1e-6)
  assert float(out.metrics["pg_loss"]) == pytest.approx(-1.0, abs=1e-6)
  assert float(out.loss) == pytest.approx(-1.0 + 0.1 * kl, abs=1e-6)
  g = jax.grad(lambda lp: policy_loss(lp, logp, jnp.array([1.0]), jnp.ones((1, 2)), s,
                                      ref_logprobs=ref).loss)(logp)
  # pg: -r A / 2 = -.5 per token; KL: .1 * (1 - pi_ref/pi) / 2 = [.025, 0]
  np.testing.assert_allclose(np.asarray(g), [[-0.475, -0.5]], atol=1e-6)


def test_mismatch_metrics_split_by_staleness():
  logp = jnp.array([[-1.0, -1.0, -2.0]])
  blp = jnp.array([[-1.0, -1.5, -2.2]])
  out = policy_loss(logp, blp, jnp.array([0.0]), jnp.array([[1.0, 1.0, 1.0]]), S,
                    token_staleness=jnp.array([[0.0, 2.0, 1.0]]))
  m = {k: float(v) for k, v in out.metrics.items()}
  assert m["mismatch/log_ratio_mean_stale0"] == pytest.approx(0.0, abs=1e-7)
  assert m["mismatch/kl_k3_stale0"] == pytest.approx(0.0, abs=1e-7)
  assert m["mismatch/log_ratio_mean_stale_gt0"] == pytest.approx((0.5 + 0.2) / 2, abs=1e-6)
  k3 = ((math.exp(0.5) - 1.5) + (math.exp(0.2) - 1.2)) / 2
  assert m["mismatch/kl_k3_stale_gt0"] == pytest.approx(k3, abs=1e-6)
  assert m["mismatch/abs_log_ratio_mean"] == pytest.approx(0.7 / 3, abs=1e-6)
  assert m["stale_token_frac"] == pytest.approx(2 / 3, abs=1e-6)
  assert m["mismatch/abs_log_ratio_stale0_max"] == pytest.approx(0.0, abs=1e-7)
  out = policy_loss(logp, blp, jnp.array([0.0]), jnp.array([[1.0, 1.0, 0.0]]), S,
                    token_staleness=jnp.array([[0.0, 0.0, 0.0]]))  # the third is not trained
  assert float(out.metrics["mismatch/abs_log_ratio_stale0_max"]) == pytest.approx(0.5, abs=1e-6)


def _random_case(seed):
  rng = np.random.default_rng(seed)
  logp = jnp.asarray(np.log(rng.uniform(0.05, 1, (4, 6))), jnp.float32)
  blp = jnp.asarray(np.log(rng.uniform(0.05, 1, (4, 6))), jnp.float32)
  adv = jnp.asarray(rng.normal(size=4), jnp.float32)
  mask = jnp.asarray(rng.random((4, 6)) < 0.8, jnp.float32)
  return logp, blp, adv, mask


@pytest.mark.parametrize("seed", [0, 1])
def test_decoupled_ppo_with_proximal_equal_to_behaviour_is_grpo(seed):
  logp, blp, adv, mask = _random_case(seed)

  def loss(name, lp):
    return policy_loss(lp, blp, adv, mask, dataclasses.replace(S, loss=name),
                       proximal_logprobs=blp).loss

  assert float(loss("decoupled_ppo", logp)) == pytest.approx(float(loss("grpo", logp)), abs=1e-7)
  np.testing.assert_allclose(jax.grad(lambda lp: loss("decoupled_ppo", lp))(logp),
                             jax.grad(lambda lp: loss("grpo", lp))(logp), atol=1e-7)


@pytest.mark.parametrize("loss_name", ["grpo", "decoupled_ppo", "gspo", "cispo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_tis_with_infinite_cap_is_no_correction(loss_name, level):
  logp, blp, adv, mask = _random_case(3)
  prox = logp + 0.3  # a real behaviour gap
  base = dataclasses.replace(S, loss=loss_name, correction_level=level)

  def run(s, lp):
    return policy_loss(lp, blp, adv, mask, s, proximal_logprobs=prox).loss

  tis = dataclasses.replace(base, correction="tis", tis_cap=math.inf)
  assert float(run(tis, logp)) == float(run(base, logp))
  np.testing.assert_array_equal(jax.grad(lambda lp: run(tis, lp))(logp),
                                jax.grad(lambda lp: run(base, lp))(logp))


def test_micro_batch_totals_make_losses_add_up():
  """Two halves normalised by the whole batch's totals add up to the whole."""
  logp, blp, adv, mask = _random_case(5)
  stale = jnp.zeros_like(mask)
  for agg in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
    s = dataclasses.replace(S, aggregation=agg, norm_length=6, loss="decoupled_ppo",
                            correction="tis", tis_cap=1.5)
    totals = BatchTotals.of(mask, stale)
    prox = logp - 0.2
    whole = policy_loss(logp, blp, adv, mask, s, proximal_logprobs=prox, totals=totals)
    halves = [policy_loss(logp[i::2], blp[i::2], adv[i::2], mask[i::2], s,
                          proximal_logprobs=prox[i::2], totals=totals) for i in (0, 1)]
    assert float(halves[0].loss + halves[1].loss) == pytest.approx(float(whole.loss), abs=1e-6)


def test_loglinear_proximal_hand_computed():
  # alpha = s / (s + 1): 0, 1/2, 3/4 of the way from log pi_b (-1) to log pi (-.5).
  out = loglinear_proximal(jnp.full((1, 3), -0.5), jnp.full((1, 3), -1.0),
                           jnp.array([[0.0, 1.0, 3.0]]))
  np.testing.assert_allclose(np.asarray(out), [[-1.0, -0.75, -0.625]], atol=1e-7)


def test_advantage_estimators_hand_computed():
  r = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
  # Group [1, 0, 0]: mean 1/3, population std sqrt(2)/3.
  np.testing.assert_allclose(compute_advantages("grpo", r, 3, eps=0.0),
                             [math.sqrt(2), -1 / math.sqrt(2), -1 / math.sqrt(2), 0, 0, 0], atol=1e-6)
  np.testing.assert_allclose(compute_advantages("drgrpo", r, 3),
                             [2 / 3, -1 / 3, -1 / 3, 0, 0, 0], atol=1e-6)
  # Leave-one-out: 1 - mean(0, 0) = 1; 0 - mean(1, 0) = -.5.
  np.testing.assert_allclose(compute_advantages("rloo", r, 3), [1, -0.5, -0.5, 0, 0, 0], atol=1e-6)
  assert ADVANTAGES.names() == ["drgrpo", "grpo", "rloo"]
  with pytest.raises(ValueError):
    compute_advantages("grpo", np.zeros(4), 3)


def test_overlong_penalty_hand_computed():
  # Budget 10 tokens, buffer 4: free up to 6, then linear to -1 at 10.
  assert [overlong_penalty(n, 10, 4) for n in (6, 8, 10, 11)] == [0.0, -0.5, -1.0, -1.0]
  assert overlong_penalty(9, 10, 4, penalty=2.0) == pytest.approx(-1.5)
  assert overlong_penalty(10, 10, 0) == 0.0
