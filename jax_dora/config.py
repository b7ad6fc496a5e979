"""Default run configuration and the checks that keep bad configs from running.

Every field a user may override with ``--config.x=y`` is declared here, so
ml_collections rejects unknown keys at parse time (``KeyError`` naming the
key) instead of a typo silently falling back to a default. ``configs/*.py``
start from :func:`base_config` and change only what differs.
"""

from __future__ import annotations

import ml_collections

MODES = (
    "sync",
    "one_step_off",
    "partial_rollout",
    "async_unfiltered",
    "dora",
    "dora_pace",
)
ASYNC_MODES = MODES[1:]
LENGTH_MODES = ("eos", "answer")


def base_config() -> ml_collections.ConfigDict:
  """Returns the full default configuration (small enough for a CPU)."""
  from jax_dora.data import default_data_config  # pylint: disable=g-import-not-at-top

  c = ml_collections.ConfigDict()
  c.mode = "sync"
  c.seed = 0
  c.output_dir = "runs/default"
  # "all": learner + embedded rollout servers in one process (Colab / CPU / single host).
  # "learner" / "rollout": separate processes or TPU slices (see launchers/).
  c.role = "all"
  c.total_steps = 60
  # Stop after this many seconds of training wall time even if total_steps is
  # not reached (0 = no limit). Benchmarks compare modes at equal budgets.
  c.max_wall_time_s = 0.0
  c.log_every = 1
  # Compile every shape the run can meet (learner length buckets, rollout
  # prefill buckets and 1..max_versions live versions) at start-up, so no step
  # stalls on a compile mid-run. Off for tiny runs, where start-up dominates.
  c.precompile = False
  c.progress_bar = True

  c.model = ml_collections.ConfigDict(
      dict(
          d_model=64,
          n_layers=2,
          n_heads=4,
          d_ff=256,
          max_seq_len=96,
          rope_base=10000.0,
          dtype="float32",
      )
  )

  c.data = default_data_config()

  c.learner = ml_collections.ConfigDict(
      dict(
          learning_rate=3e-3,
          warmup_steps=5,
          weight_decay=0.0,
          grad_clip=1.0,
          group_size=8,  # G: completions per prompt (GRPO group)
          groups_per_step=8,  # prompts per optimizer step
          clip_eps=0.2,
          clip_eps_high=0.28,
          kl_coef=0.0,
          advantage_eps=1e-6,
          normalize_adv_std=True,
          # Training rows are padded to the smallest of these lengths that
          # fits the batch (model.max_seq_len is always the last bucket): one
          # compile per bucket, no paying for max_seq_len on short answers.
          # "" = always max_seq_len.
          seq_len_buckets="48,64",
          # Learner devices: the first `num_devices` of jax.devices() (-1 = all not
          # given to rollout). Mesh axes (data, fsdp, tensor); -1 absorbs the rest.
          num_devices=4,
          mesh_data=-1,
          mesh_fsdp=1,
          mesh_tensor=1,
      )
  )

  c.rollout = ml_collections.ConfigDict(
      dict(
          num_servers=2,
          devices_per_server=1,
          slots=16,  # decode slots per server (max_concurrent_decodes)
          max_prefill_length=32,
          max_new_tokens=56,
          # "eos": a rollout ends at EOS or max_new_tokens (training).
          # "answer": a rollout generates exactly len(answer) tokens, EOS
          # ignored (vLLM's ignore_eos), so the workload's long-tailed length
          # law, not the policy's current habits, sets every rollout's length:
          # benchmarks compare modes on identical work this way.
          length_mode="eos",
          temperature=1.0,
          top_p=1.0,
          max_versions=3,  # policy versions a server may hold at once
          # Server mode (role=rollout / learner with remote servers).
          port=9000,
          server_addresses="",  # comma-separated host:port; empty = embedded servers
          request_timeout_s=120.0,
      )
  )

  c.snapshots = ml_collections.ConfigDict(
      dict(directory="", max_to_keep=4)  # "" = <output_dir>/snapshots
  )

  c.orchestrator = ml_collections.ConfigDict(
      dict(
          max_staleness=2,
          # Requests in flight per server beyond its slots (keeps slots full).
          queue_depth=4,
          # partial_rollout: batch deadline as a fraction of the longest rollout.
          partial_rollout_fraction=0.5,
          max_server_restarts=3,
          # async_unfiltered / dora / dora_pace: the learner only copies its
          # params and goes on training while the Orbax write (and the
          # servers' load) runs in the background; versions produced meanwhile
          # are coalesced to the newest. sync / one_step_off / partial_rollout
          # always publish before generating again.
          async_publish=True,
      )
  )

  c.pace = ml_collections.ConfigDict(
      dict(
          target_pool_groups=4,
          gain=0.5,
          min_budget=0,
          max_budget=4,
          smoothing=0.5,
          generation_weight=0.5,
          waiting_weight=1.0,
          on_reject="regenerate",
          versions_per_token=0.0,  # 0 = estimate from the pool
          generation_slack=1.0,
      )
  )

  c.checkpoint = ml_collections.ConfigDict(
      dict(every_steps=0, max_to_keep=2, resume=True)  # 0 = only at the end
  )

  c.eval = ml_collections.ConfigDict(dict(every_steps=10, num_prompts=64, at_start=True))

  c.distributed = ml_collections.ConfigDict(
      dict(
          enabled=False,
          coordinator_address="",
          num_processes=-1,
          process_id=-1,
          # Processes 0..n-1 of the jax.distributed cluster are the learner; the
          # others are rollout servers (server_main) sharing the cluster, each on
          # its local devices. -1 = the whole cluster is the learner (a TPU
          # learner slice with its own cluster; rollout slices run apart).
          num_learner_processes=-1,
      )
  )
  return c


class ConfigError(ValueError):
  """A config value is out of range or inconsistent with another."""


def validate(c: ml_collections.ConfigDict) -> None:
  """Raises :class:`ConfigError` with an actionable message on bad values."""
  if c.mode not in MODES:
    raise ConfigError(f"config.mode={c.mode!r} is not one of {MODES}")
  if c.role not in ("all", "learner", "rollout"):
    raise ConfigError(f"config.role={c.role!r} must be all, learner or rollout")
  if c.learner.group_size < 2:
    raise ConfigError("config.learner.group_size must be >= 2 for GRPO advantages")
  if c.orchestrator.max_staleness < 0:
    raise ConfigError("config.orchestrator.max_staleness must be >= 0")
  if c.rollout.max_versions < 1:
    raise ConfigError("config.rollout.max_versions must be >= 1")
  need = c.rollout.max_prefill_length + c.rollout.max_new_tokens
  if need > c.model.max_seq_len:
    raise ConfigError(
        f"rollout.max_prefill_length + rollout.max_new_tokens = {need} exceeds"
        f" model.max_seq_len = {c.model.max_seq_len}"
    )
  if c.data.max_answer_len + 1 > c.rollout.max_new_tokens:
    raise ConfigError(
        f"data.max_answer_len={c.data.max_answer_len} needs rollout.max_new_tokens >="
        f" {c.data.max_answer_len + 1} (answer + EOS)"
    )
  if c.data.max_prompt_len + 1 > c.rollout.max_prefill_length:
    raise ConfigError(
        f"data.max_prompt_len={c.data.max_prompt_len} needs rollout.max_prefill_length >="
        f" {c.data.max_prompt_len + 1} (prompt + BOS)"
    )
  try:
    from jax_dora.learner.batching import parse_buckets  # pylint: disable=g-import-not-at-top

    parse_buckets(str(c.learner.seq_len_buckets), c.model.max_seq_len)
  except ValueError as e:
    raise ConfigError(f"config.learner.seq_len_buckets={c.learner.seq_len_buckets!r}: {e}") from e
  if c.distributed.num_learner_processes == 0 or c.distributed.num_learner_processes < -1:
    raise ConfigError("config.distributed.num_learner_processes must be -1 (all) or >= 1")
  if c.rollout.length_mode not in LENGTH_MODES:
    raise ConfigError(f"config.rollout.length_mode={c.rollout.length_mode!r} is not one of {LENGTH_MODES}")
  if c.pace.on_reject not in ("regenerate", "drop"):
    raise ConfigError("config.pace.on_reject must be 'regenerate' or 'drop'")
