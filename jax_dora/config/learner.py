"""``config.learner``: the optimizer, the loss and how a batch is computed."""

from __future__ import annotations

import dataclasses

from jax_dora.config.block import ConfigBlock, ConfigError, choice, field

IS_LEVELS = ("token", "sequence")
PROXIMAL_LOGPROBS = ("recompute", "loglinear")
MOE_ROUTING = ("recompute", "replay")


@dataclasses.dataclass(frozen=True)
class LearnerConfig(ConfigBlock):
  """The learner's hyper-parameters, read by ``jax_dora.learner.Learner``."""

  BLOCK = "learner"

  learning_rate: float = field(3e-3, "Peak AdamW learning rate.")
  warmup_steps: int = field(5, "Linear warm-up steps of the learning rate.")
  lr_decay_steps: int = field(
      0, "Cosine decay of the learning rate over this many steps after warm-up, to"
      " lr_final_fraction of the peak (0 = constant after warm-up, RL's usual schedule; SFT"
      " decays).")
  lr_final_fraction: float = field(0.1, "Learning rate at the end of the cosine decay / peak.")
  moe_aux_loss_coef: float = field(
      -1.0, "MoE load-balancing loss coefficient (transformers' formula); -1 = the"
      " checkpoint's router_aux_loss_coef (model.router_aux_loss_coef).")
  moe_z_loss_coef: float = field(0.0, "MoE router z-loss coefficient (ST-MoE); 0 = off.")
  moe_routing: str = field(
      "recompute", "MoE routing in the learner's forward: recompute (its own router's top-k) |"
      " replay (the experts the rollout server routed each token to, weighed by the live"
      " router's softmax so the router still trains). Servers record routes either way;"
      " moe/route_mismatch is the share the learner's router would pick differently.")
  weight_decay: float = field(0.0, "AdamW weight decay.")
  grad_clip: float = field(1.0, "Global gradient-norm clip.")
  group_size: int = field(8, "G: completions per prompt (GRPO group).")
  groups_per_step: int = field(8, "Prompts per optimizer step.")
  loss: str = field(
      "grpo", "The objective (jax_dora.learner.losses): grpo (PPO clip of pi / pi_behaviour)"
      " | decoupled_ppo (AReaL: clip pi / pi_prox, weight pi_prox / pi_behaviour) | gspo"
      " (sequence ratio) | cispo (clipped, detached IS weight on log pi) | sft (cross-entropy"
      " of the completion tokens: python -m jax_dora.sft).")
  clip_eps: float = field(0.2, "PPO clip, low side.")
  clip_eps_high: float = field(0.28, "PPO clip, high side (DAPO's clip-higher).")
  gspo_clip_eps: float = field(3e-4, "GSPO sequence-ratio clip, low side.")
  gspo_clip_eps_high: float = field(4e-4, "GSPO sequence-ratio clip, high side.")
  cispo_clip_high: float = field(5.0, "CISPO weight <= 1 + this.")
  is_correction: str = field(
      "none", "Correction of the behaviour-policy gap rho = pi_prox / pi_behaviour: none |"
      " tis (min(rho, tis_cap)) | mis (drop tokens with rho outside [mis_low, mis_high]).")
  is_level: str = field("token", "Correction per token or per sequence (geometric mean).")
  tis_cap: float = field(2.0, "TIS cap on rho.")
  mis_low: float = field(0.5, "MIS: lowest rho kept.")
  mis_high: float = field(2.0, "MIS: highest rho kept.")
  proximal_logprobs: str = field(
      "recompute", "pi_prox: recompute (the current version's parameters: free with one update"
      " per step) | loglinear (AReaL's interpolation between behaviour and current).")
  ppo_minibatches: int = field(
      1, "Optimizer updates per learner step (the batch split in as many minibatches); one"
      " step still publishes one version.")
  loss_aggregation: str = field(
      "token_mean", "token_mean (DAPO) | seq_mean_token_mean (GRPO) | seq_mean_token_sum_norm"
      " (Dr.GRPO; divides by rows x loss_norm_length).")
  loss_norm_length: int = field(0, "Dr.GRPO's constant length; 0 = model.max_seq_len.")
  kl_coef: float = field(0.0, "KL penalty to the initial policy (0 = no reference model).")
  advantage_estimator: str = field(
      "grpo", "grpo ((r - mean) / std) | drgrpo (r - mean) | rloo (leave-one-out).")
  advantage_eps: float = field(1e-6, "Added to the group's reward std.")
  dynamic_sampling: bool = field(
      False, "Drop groups whose members all got the same reward (zero advantage) before they"
      " take batch space, and draw new prompts instead (DAPO).")
  dynamic_sampling_max_draws: int = field(
      4, "After (max_draws - 1) x groups_per_step drops in one step the rest are trained as"
      " they are, so a task the policy always fails cannot stall the run.")
  mask_truncated: bool = field(False, "Zero the loss of completions cut off at the length limit (DAPO).")
  logprob_chunk_size: int = field(
      512, "Log-probs are computed from the hidden states this many positions at a time, so"
      " [B, T, V] float32 logits never exist (0 = all at once).")
  micro_batch_size: int = field(
      0, "Rows per forward/backward pass; gradients are accumulated into one optimizer step"
      " (0 = the whole batch at once).")
  group_micro_batches_by_length: bool = field(
      False, "Cut the micro-batches from the rows sorted by length, each padded to its own"
      " seq_len bucket: with long-tailed answers the short rows stop paying for the longest"
      " one. Same update; needs micro_batch_size > 0.")
  remat: str = field("none", "Per-block rematerialisation: none | full | dots | dots_no_batch.")
  seq_len_buckets: str = field(
      "48,64", "Training rows are padded to the smallest of these lengths that fits the batch"
      " (model.max_seq_len is always the last): one compile per bucket. \"\" = always"
      " max_seq_len.")
  num_devices: int = field(
      4, "Learner devices: the first num_devices of jax.devices() (-1 = all not given to"
      " rollout).")
  mesh_data: int = field(-1, "Mesh axis data (-1 absorbs the rest).")
  mesh_fsdp: int = field(1, "Mesh axis fsdp.")
  mesh_tensor: int = field(1, "Mesh axis tensor.")
  mesh_expert: int = field(
      1, "Mesh axis expert (MoE expert parallelism: experts divided, rows split as over data).")
  dump_batches_dir: str = field(
      "", "Save every trained batch as <dir>/step_<n>.npz (\"\" = off): replay a run's updates"
      " offline, or compare learners on identical data.")

  @property
  def batch_rows(self) -> int:
    """Trajectories per learner step (groups_per_step x group_size)."""
    return self.groups_per_step * self.group_size

  def __post_init__(self):
    from jax_dora.learner import losses  # pylint: disable=g-import-not-at-top
    from jax_dora.model.transformer import REMAT_POLICIES  # pylint: disable=g-import-not-at-top

    if self.group_size < 2:
      self.fail("group_size", "must be >= 2 for GRPO advantages")
    if self.moe_aux_loss_coef < 0 and self.moe_aux_loss_coef != -1:
      self.fail("moe_aux_loss_coef", "must be >= 0, or -1 for the checkpoint's coefficient")
    if self.moe_z_loss_coef < 0:
      self.fail("moe_z_loss_coef", "must be >= 0")
    if self.groups_per_step < 1:
      self.fail("groups_per_step", "must be >= 1")
    if self.lr_decay_steps < 0 or not 0 <= self.lr_final_fraction <= 1:
      self.fail("lr_decay_steps", "needs lr_decay_steps >= 0 and lr_final_fraction in [0, 1]")
    for key, registry in (("loss", losses.OBJECTIVES), ("is_correction", losses.CORRECTIONS),
                          ("loss_aggregation", losses.AGGREGATIONS),
                          ("advantage_estimator", losses.ADVANTAGES)):
      choice(self.BLOCK, key, getattr(self, key), registry.names())
    choice(self.BLOCK, "is_level", self.is_level, IS_LEVELS)
    choice(self.BLOCK, "proximal_logprobs", self.proximal_logprobs, PROXIMAL_LOGPROBS)
    choice(self.BLOCK, "moe_routing", self.moe_routing, MOE_ROUTING)
    choice(self.BLOCK, "remat", self.remat, sorted(REMAT_POLICIES))
    if not self.tis_cap > 0 or not 0 <= self.mis_low < self.mis_high:
      raise ConfigError("config.learner.tis_cap must be > 0 and 0 <= mis_low < mis_high")
    if min(self.clip_eps, self.clip_eps_high, self.gspo_clip_eps, self.gspo_clip_eps_high,
           self.cispo_clip_high) < 0 or self.loss_norm_length < 0:
      raise ConfigError("config.learner clip ranges and loss_norm_length must be >= 0")
    if self.micro_batch_size < 0 or self.logprob_chunk_size < 0:
      raise ConfigError("config.learner.micro_batch_size and logprob_chunk_size must be >= 0")
    batch = self.batch_rows
    if self.micro_batch_size and batch % self.micro_batch_size:
      self.fail("micro_batch_size", f"does not divide the batch of {batch} trajectories"
                " (groups_per_step x group_size)")
    if self.ppo_minibatches < 1 or batch % self.ppo_minibatches:
      self.fail("ppo_minibatches", f"must be >= 1 and divide the batch of {batch} trajectories")
    mini = batch // self.ppo_minibatches
    if self.micro_batch_size and self.micro_batch_size < mini and mini % self.micro_batch_size:
      self.fail("micro_batch_size", f"does not divide a minibatch of {mini} trajectories"
                " (batch / ppo_minibatches)")
    if self.group_micro_batches_by_length and not self.micro_batch_size:
      raise ConfigError("config.learner.group_micro_batches_by_length needs"
                        " config.learner.micro_batch_size > 0 (the rows of one micro-batch)")
    if self.dynamic_sampling_max_draws < 1:
      self.fail("dynamic_sampling_max_draws", "must be >= 1")
    if self.warmup_steps < 0 or self.learning_rate < 0:
      raise ConfigError("config.learner.warmup_steps and learning_rate must be >= 0")
