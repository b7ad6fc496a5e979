"""Mixture-of-experts layers (issue 26): routing, grouped matmuls, router losses, training.

Oracles: a per-token numpy loop written here (``sum_j w_j * FFN_{e_j}(x)``
with the softmax and top-k done by hand), transformers'
``load_balancing_loss_func`` for the load-balancing loss, and (in
``test_hf_models.py``) transformers' ``Qwen3MoeForCausalLM`` for whole-model
logits and KV-cache decode.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dora.config import base_config
from jax_dora.learner.router_losses import router_losses, router_stats
from jax_dora.model.config import ModelConfig
from jax_dora.model.moe import MoE
from jax_dora.model.transformer import Transformer

# The grouped path, explicitly: on CPU "auto" takes the dense one.
CFG = ModelConfig(vocab_size=40, d_model=16, n_layers=3, n_heads=2, d_ff=24, num_experts=4,
                  num_experts_per_tok=2, moe_d_ff=8, mlp_only_layers=(1,), moe_impl="ragged")


def _naive_moe(x, router, wi_0, wi_1, wo, k, norm):
  """Per token, in float64: softmax, top-k, renormalise, weighted SwiGLU experts."""
  x, router = np.asarray(x, np.float64), np.asarray(router, np.float64)
  out = np.zeros_like(x)
  for n in range(x.shape[0]):
    z = x[n] @ router
    p = np.exp(z - z.max())
    p /= p.sum()
    top = np.argsort(-p, kind="stable")[:k]
    w = p[top] / (p[top].sum() if norm else 1.0)
    for e, we in zip(top, w):
      g, u = x[n] @ wi_0[e], x[n] @ wi_1[e]
      out[n] += we * ((g / (1 + np.exp(-g))) * u) @ wo[e]
  return out


@pytest.mark.parametrize("impl", ["ragged", "dense"])
@pytest.mark.parametrize("norm", [False, True])
def test_moe_layer_equals_a_per_token_loop(norm, impl):
  """Both expert paths (grouped ragged_dot; every token through every expert, CPU's
  default) equal the loop."""
  cfg = ModelConfig(**{**CFG.to_dict(), "norm_topk_prob": norm, "moe_impl": impl})
  x = jax.random.normal(jax.random.key(0), (2, 7, cfg.d_model))
  params = MoE(cfg).init(jax.random.key(1), x)["params"]
  p = jax.tree.map(np.asarray, jax.tree.map(lambda v: getattr(v, "value", v), params,
                                            is_leaf=lambda v: hasattr(v, "value")))
  ours = MoE(cfg).apply({"params": params}, x)
  ref = _naive_moe(np.asarray(x).reshape(-1, cfg.d_model), p["router"]["kernel"], p["wi_0"],
                   p["wi_1"], p["wo"], cfg.num_experts_per_tok, norm)
  np.testing.assert_allclose(np.asarray(ours).reshape(-1, cfg.d_model), ref, atol=2e-5)


def test_dropless_when_every_token_picks_the_same_experts():
  """No capacity: 14 tokens all routed to experts 0 and 1 are all computed."""
  x = jax.random.normal(jax.random.key(2), (1, 14, CFG.d_model))
  params = MoE(CFG).init(jax.random.key(3), x)["params"]
  router = np.zeros((CFG.d_model, CFG.num_experts), np.float32)
  router[:, 0], router[:, 1] = 50.0, 49.0
  x = jnp.abs(x)  # positive features: every token's logits put experts 0, 1 on top
  params = jax.tree.map(lambda v: v, params)
  params["router"]["kernel"] = params["router"]["kernel"].replace_boxed(jnp.asarray(router))
  p = jax.tree.map(lambda v: np.asarray(getattr(v, "value", v)), params,
                   is_leaf=lambda v: hasattr(v, "value"))
  out, inter = MoE(CFG).apply({"params": params}, x, mutable=["intermediates"])
  ref = _naive_moe(np.asarray(x)[0], router, p["wi_0"], p["wi_1"], p["wo"], 2, False)
  np.testing.assert_allclose(np.asarray(out)[0], ref, atol=2e-5)
  (stats,) = inter["intermediates"]["router_stats"]
  np.testing.assert_array_equal(np.asarray(stats["expert_hits"]), [14, 14, 0, 0])
  _, metrics = router_losses(jax.tree.map(lambda a: a[None], stats), 2, (0,))
  assert float(metrics["moe/dropped_tokens"]) == 0.0
  assert float(metrics["moe/expert_load_max"]) == pytest.approx(2.0)  # 14 / mean 7


def test_load_balancing_loss_equals_transformers():
  import torch
  from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

  model = Transformer(CFG)
  tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, size=(3, 9))
  positions = np.broadcast_to(np.arange(9), (3, 9))
  valid = np.ones((3, 9), bool)
  valid[1, 6:] = valid[2, 3:] = False  # right padding
  variables = model.init(jax.random.key(4), tokens, positions)
  _, inter = model.apply(variables, tokens, positions, token_mask=valid,
                         mutable=["intermediates"])
  stats = router_stats(inter)
  losses, metrics = router_losses(stats, CFG.num_experts_per_tok, CFG.moe_layers)
  # The oracle takes each MoE layer's router logits: recompute them from the normed inputs.
  logits = []
  _, inter_all = model.apply(variables, tokens, positions, capture_intermediates=True,
                             mutable=["intermediates"])
  for layer in CFG.moe_layers:
    logits.append(torch.from_numpy(np.array(
        inter_all["intermediates"][f"layers_{layer}"]["mlp"]["router"]["__call__"][0]
    ).reshape(-1, CFG.num_experts)))
  ref = load_balancing_loss_func(tuple(logits), CFG.num_experts, CFG.num_experts_per_tok,
                                 torch.from_numpy(valid.astype(np.int64)))
  assert float(losses["load_balance"]) == pytest.approx(float(ref), rel=1e-5)
  assert float(metrics["moe/dropped_tokens"]) == 0.0
  assert 0.0 < float(metrics["moe/router_entropy"]) <= np.log(CFG.num_experts) + 1e-6
  assert float(losses["z_loss"]) > 0.0
  assert set(k for k in metrics if k.startswith("moe/layer")) == {
      "moe/layer0/expert_load_max", "moe/layer2/expert_load_max"}


def test_the_router_gets_gradients_through_the_selected_weights():
  x = jax.random.normal(jax.random.key(5), (2, 5, CFG.d_model))
  params = MoE(CFG).init(jax.random.key(6), x)["params"]
  grads = jax.grad(lambda p: jnp.sum(MoE(CFG).apply({"params": p}, x) ** 2))(params)
  g = np.asarray(grads["router"]["kernel"].value)
  assert np.all(np.isfinite(g)) and np.abs(g).sum() > 1e-3


def test_moe_config_errors_and_layer_rule():
  assert CFG.moe_layers == (0, 2)
  assert ModelConfig(**{**CFG.to_dict(), "mlp_only_layers": (), "moe_layer_step": 2}
                     ).moe_layers == (1,)
  with pytest.raises(ValueError, match="num_experts_per_tok"):
    ModelConfig(**{**CFG.to_dict(), "num_experts_per_tok": 5})
  with pytest.raises(ValueError, match="mlp_only_layers"):
    ModelConfig(**{**CFG.to_dict(), "mlp_only_layers": (3,)})
  with pytest.raises(ValueError, match="scan_layers needs every layer alike"):
    tokens = np.zeros((1, 4), np.int32)
    Transformer(CFG, scan_layers=True).init(jax.random.key(0), tokens, tokens)


@pytest.mark.parametrize("mode,moe_routing", [("sync", "recompute"), ("dora_pace", "replay")])
def test_a_tiny_moe_policy_trains_with_a_clean_audit(tmp_path: pathlib.Path, mode, moe_routing):
  """Both modes, and routing replay: servers record every route the trained tokens
  condition on (the ledger's ``unrouted`` is 0), the learner reports the share its
  own router would pick differently."""
  from jax_dora.runtime import run_training  # pylint: disable=g-import-not-at-top

  cfg = base_config()
  cfg.mode = mode
  cfg.learner.moe_routing = moe_routing
  cfg.output_dir = str(tmp_path / mode)
  cfg.total_steps = 3
  cfg.progress_bar = False
  cfg.eval.num_prompts = 0
  cfg.eval.at_start = False
  cfg.model.num_experts = 4
  cfg.model.num_experts_per_tok = 2
  cfg.model.moe_d_ff = 32
  cfg.model.mlp_only_layers = "1"
  cfg.learner.moe_aux_loss_coef = 0.01
  cfg.learner.moe_z_loss_coef = 0.001
  cfg.audit.verify_fraction = 1.0  # labels recomputed with the recorded routes (replay) or not
  cfg.audit.label_time_share = 1.0
  summary = run_training(cfg)
  assert summary["steps"] == 3 and summary["integrity_violations"] == []
  assert summary["audit"]["labels_checked"] > 0
  import json  # pylint: disable=g-import-not-at-top
  recs = [json.loads(line) for line in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()]
  last = recs[-1]
  assert last["train/moe/dropped_tokens"] == 0.0
  assert 1.0 <= last["train/moe/expert_load_max"] <= 4.0
  assert last["train/moe/load_balance_loss"] > 0.0 and last["train/moe/router_entropy"] > 0.0
  assert "train/moe/layer0/expert_load_max" in last and "train/moe/layer1/expert_load_max" not in last
  assert 0.0 <= last["train/moe/route_mismatch"] < 0.5
  trained = [json.loads(line) for line in
             (tmp_path / mode / "trained_samples.jsonl").read_text().splitlines()]
  trained = [r for r in trained if r.get("event") == "trained"]
  assert trained and all(r["unrouted"] == 0 for r in trained)


@pytest.mark.parametrize("impl", ["ragged", "dense"])
def test_expert_parallel_step_equals_one_device(impl):
  """A (data=2, expert=2, tensor=2) mesh: each MoE layer's experts split over the expert
  axis, rows over data x expert; two train steps give one device's losses."""
  from jax_dora.learner.mesh import make_mesh  # pylint: disable=g-import-not-at-top
  from jax_dora.learner.train_state import Learner  # pylint: disable=g-import-not-at-top

  cfg = base_config()
  cfg.learner.warmup_steps = 1
  cfg.learner.moe_aux_loss_coef = 0.01
  model_cfg = ModelConfig(vocab_size=48, d_model=32, n_layers=2, n_heads=4, d_ff=64,
                          max_seq_len=24, num_experts=4, num_experts_per_tok=2, moe_d_ff=16,
                          moe_impl=impl)
  rng = np.random.default_rng(0)
  b, t = 8, 23
  tokens = rng.integers(3, 48, size=(b, t + 1)).astype(np.int32)
  mask = np.zeros((b, t), np.float32)
  mask[:, 5:] = 1.0
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
           "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),
           "mask": mask, "behaviour_logprobs": np.full((b, t), -3.0, np.float32) * mask,
           "advantages": rng.normal(size=(b,)).astype(np.float32),
           "token_staleness": np.zeros((b, t), np.float32)}
  single = Learner(model_cfg, cfg.learner, make_mesh(jax.devices()[:1]), seed=3)
  ep = Learner(model_cfg, cfg.learner, make_mesh(jax.devices(), 2, 1, 2, expert=2), seed=3)
  wi = ep.params["layers_0"]["mlp"]["wi_0"]
  assert wi.sharding.spec[0] == "expert" and len(wi.addressable_shards[0].data) == 2
  losses = []
  for learner in (single, ep):
    m1 = learner.train_step(batch)
    m2 = learner.train_step(batch)
    losses.append((m1["loss"], m2["loss"], m1["grad_norm"], m1["moe/load_balance_loss"]))
  np.testing.assert_allclose(losses[0], losses[1], rtol=2e-4, atol=1e-5)
  assert losses[0][0] != losses[0][1]


def test_routing_replay_weights_come_from_the_live_softmax():
  """Replaying the router's own choice reproduces it exactly; replaying experts the learner
  would not pick keeps their (small) live probabilities and their gradients. Gathering from
  probabilities zeroed outside the learner's own top-k (the pitfall) gives them 0 and kills
  the router's gradient through them."""
  from jax_dora.model.moe import replayed_weights, route  # pylint: disable=g-import-not-at-top

  logits = jnp.asarray([[3.0, 1.0, 0.5, -1.0], [0.0, 2.0, 1.0, 0.2]])
  for norm in (False, True):
    w, ids = route(logits, 2, norm)
    np.testing.assert_allclose(replayed_weights(logits, ids, norm), w, rtol=1e-6)
  recorded = jnp.asarray([[2, 3], [0, 3]])  # none of the learner's own top-2
  w = replayed_weights(logits, recorded, False)
  p = np.exp(np.asarray(logits)) / np.exp(np.asarray(logits)).sum(-1, keepdims=True)
  np.testing.assert_allclose(w, np.take_along_axis(p, np.asarray(recorded), -1), rtol=1e-6)
  g = jax.grad(lambda z: jnp.sum(replayed_weights(z, recorded, False)))(logits)
  assert np.all(np.abs(np.asarray(g)) > 1e-4)  # every logit moves, the recorded ones most

  def pitfall(z):
    probs = jax.nn.softmax(z, -1)
    top, _ = jax.lax.top_k(probs, 2)
    zeroed = jnp.where(probs >= top[:, -1:], probs, 0.0)
    return jnp.sum(jnp.take_along_axis(zeroed, recorded, -1))

  assert float(pitfall(logits)) == 0.0
  assert np.all(np.asarray(jax.grad(pitfall)(logits)) == 0.0)


def test_an_moe_layer_replaying_its_own_routing_is_unchanged():
  x = jax.random.normal(jax.random.key(7), (2, 5, CFG.d_model))
  params = MoE(CFG).init(jax.random.key(8), x)["params"]
  plain = MoE(CFG).apply({"params": params}, x)
  kernel = np.asarray(params["router"]["kernel"].value)
  logits = np.asarray(x, np.float64).reshape(-1, CFG.d_model) @ kernel
  own = np.argsort(-logits, axis=-1, kind="stable")[:, :CFG.num_experts_per_tok]
  replayed = MoE(CFG).apply({"params": params}, x, recorded_ids=own.reshape(2, 5, -1))
  np.testing.assert_allclose(np.asarray(replayed), np.asarray(plain), atol=1e-6)
  other = (own + 1) % CFG.num_experts  # different experts: a different output
  assert not np.allclose(np.asarray(MoE(CFG).apply({"params": params}, x,
                                                   recorded_ids=other.reshape(2, 5, -1))),
                         np.asarray(plain), atol=1e-4)
