"""Default run configuration and the checks that keep bad configs from running.

Every field a user may override with ``--config.x=y`` is declared here, so
ml_collections rejects unknown keys at parse time (``KeyError`` naming the
key) instead of a typo silently falling back to a default. ``configs/*.py``
start from :func:`base_config` and change only what differs.
"""

from __future__ import annotations

import jax.numpy as jnp
from typing import Any

import ml_collections
import numpy as np

from jax_dora.csv_fields import split_csv
from jax_dora.orchestrator.modes import MODES as _MODE_STRATEGIES

# Names of the training modes (jax_dora.orchestrator.modes owns them).
MODES = tuple(_MODE_STRATEGIES)
LENGTH_MODES = ("eos", "answer")


def base_config() -> ml_collections.ConfigDict:
  """Returns the full default configuration (small enough for a CPU)."""
  from jax_dora.data import default_data_config  # pylint: disable=g-import-not-at-top

  c = ml_collections.ConfigDict()
  c.mode = "sync"
  c.seed = 0
  c.output_dir = "runs/default"
  # "all": learner + embedded rollout servers in one process (Colab / CPU /
  # single host); rollout.server_addresses must be empty.
  # "learner": the learner and orchestrator only, with remote rollout servers
  # at rollout.server_addresses (required). "rollout": a rollout server
  # (``jax_dora.rollout.server_main``); jax_dora.train refuses it.
  c.role = "all"
  c.total_steps = 60
  # Stop after this many seconds of training wall time even if total_steps is
  # not reached (0 = no limit). Benchmarks compare modes at equal budgets.
  c.max_wall_time_s = 0.0
  # One readable log line (step, reward, bubble, throughput, staleness) every
  # this many learner steps; 0 = none (metrics.jsonl has every step anyway).
  # Long runs without a terminal (TPU pods, nohup) read these.
  c.log_every = 10
  # Compile every shape the run can meet (learner length buckets, rollout
  # prefill buckets and 1..max_versions live versions) at start-up, so no step
  # stalls on a compile mid-run. Off here for the tests' few-step runs, where
  # start-up dominates; every configs/*.py run sets it.
  c.precompile = False
  # JAX's persistent compilation cache (jax_dora.compile_cache): a second
  # start of the same run loads its compiled programs instead of compiling
  # them. "auto" = $JAX_COMPILATION_CACHE_DIR, else
  # $XDG_CACHE_HOME/jax_dora/xla (~/.cache/jax_dora/xla); a path; "" = off.
  c.compile_cache_dir = "auto"
  c.progress_bar = True

  # The tiny native character model. A Hugging Face model sets ``hf_path``
  # (a local directory with config.json, safetensors and tokenizer files) and
  # leaves the architecture fields unset (None): they come from config.json,
  # and any value set here must agree with it (see hf_model_config).
  c.model = ml_collections.ConfigDict(
      dict(
          hf_path="",
          d_model=64,
          n_layers=2,
          n_heads=4,
          n_kv_heads=0,  # 0 = n_heads (no GQA)
          head_dim=0,  # 0 = d_model // n_heads
          d_ff=256,
          max_seq_len=96,  # KV cache / training row length: always a run choice
          rope_theta=10000.0,
          rope_scaling="",  # "" or "llama3"
          rope_scaling_factor=1.0,
          rope_low_freq_factor=1.0,
          rope_high_freq_factor=4.0,
          rope_original_max_len=8192,
          norm_eps=1e-6,
          qkv_bias=False,
          out_bias=False,
          qk_norm=False,
          tie_embeddings=False,
          # Params (and Adam moments) are stored in param_dtype; activations
          # and the KV cache use dtype; softmax, logits, log-probs and the
          # loss are always float32. bfloat16 dtype + float32 params is the
          # usual accelerator setting.
          param_dtype="float32",
          dtype="float32",
          # Kernel of training / prefill attention: "auto" = cuDNN flash
          # attention on a GPU with bfloat16/float16 activations, XLA
          # elsewhere; "xla" or "cudnn" to force one.
          attention_impl="auto",
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
          # The loss, by name (jax_dora.learner.losses): grpo (PPO clip of
          # pi / pi_behaviour) | decoupled_ppo (AReaL: clip pi / pi_prox,
          # weight pi_prox / pi_behaviour) | gspo (sequence ratio) | cispo
          # (clipped, detached IS weight on log pi).
          loss="grpo",
          clip_eps=0.2,
          clip_eps_high=0.28,
          gspo_clip_eps=3e-4,
          gspo_clip_eps_high=4e-4,
          cispo_clip_high=5.0,  # CISPO weight <= 1 + this
          # Correction of the behaviour-policy gap rho = pi_prox / pi_behaviour:
          # none | tis (min(rho, tis_cap)) | mis (drop tokens with rho outside
          # [mis_low, mis_high]); per token or per sequence (geometric mean).
          is_correction="none",
          is_level="token",
          tis_cap=2.0,
          mis_low=0.5,
          mis_high=2.0,
          # pi_prox: recompute (the current version's parameters: free with one
          # update per step, one forward pass with ppo_minibatches > 1) |
          # loglinear (AReaL's interpolation between behaviour and current).
          proximal_logprobs="recompute",
          # Optimizer updates per learner step (the batch split in as many
          # minibatches); one step still publishes one version.
          ppo_minibatches=1,
          # token_mean (DAPO) | seq_mean_token_mean (GRPO) |
          # seq_mean_token_sum_norm (Dr.GRPO; divides by rows x loss_norm_length,
          # 0 = model.max_seq_len).
          loss_aggregation="token_mean",
          loss_norm_length=0,
          kl_coef=0.0,
          # grpo ((r - mean) / std) | drgrpo (r - mean) | rloo (leave-one-out).
          advantage_estimator="grpo",
          advantage_eps=1e-6,
          # Drop groups whose members all got the same reward (zero advantage)
          # before they take batch space, and draw new prompts instead (DAPO).
          # After (max_draws - 1) x groups_per_step drops in one step the rest
          # are trained as they are, so a task the policy always fails cannot
          # stall the run.
          dynamic_sampling=False,
          dynamic_sampling_max_draws=4,
          # Zero the loss of completions cut off at the length limit (DAPO).
          mask_truncated=False,
          # Memory: log-probs are computed from the hidden states this many
          # positions at a time, so [B, T, V] float32 logits never exist
          # (0 = all at once; rows shorter than the chunk are not split).
          logprob_chunk_size=512,
          # Rows per forward/backward pass; gradients of the micro-batches are
          # accumulated into one optimizer step (0 = the whole batch at once).
          micro_batch_size=0,
          # Cut the micro-batches from the rows sorted by length, each padded
          # to its own seq_len bucket (one jitted call per micro-batch): with
          # long-tailed answers the short rows stop paying for the longest
          # one. Same update; needs micro_batch_size > 0.
          group_micro_batches_by_length=False,
          # Per-block rematerialisation: none | full | dots | dots_no_batch.
          remat="none",
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
          # Save every trained batch as <dir>/step_<n>.npz ("" = off): replay
          # a run's updates offline, or compare learners on identical data.
          dump_batches_dir="",
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
          # Devices of one server that split the model (heads, MLP, vocab) for
          # tensor parallelism; the server's other devices split the slots.
          tensor_parallel=1,
          # Decode attention: "blocked" reads only the KV-cache entries below
          # the smallest decode_length_buckets entry that holds the longest
          # live row (the host knows every slot's position, so each bucket is
          # one static program: no device-side loop or branch), in chunks of
          # attention_block entries (online softmax; the scores of a chunk
          # take slots x query heads x attention_block x 4 bytes; 0 = 2048 on
          # a GPU/TPU, one chunk and no loop for most bounds, 128 on CPU,
          # where XLA is ~5x faster over cache-sized blocks).
          # "dense" scores the whole cache (the old path, to measure against).
          # decode_length_buckets: comma-separated bounds, "" = doubling from
          # max(128, model.max_seq_len // 32); model.max_seq_len is always the
          # last. Each bucket is a compiled decode program (times the
          # multi-version pass shapes), so few buckets = short warm-up.
          decode_attention="blocked",
          attention_block=0,
          decode_length_buckets="",
          # One admission round is one batched prefill of up to this many
          # (padded) tokens per device call; share_prompt_prefill computes the
          # identical prompts of a GRPO group once and copies their KV entries.
          prefill_batch_tokens=4096,
          share_prompt_prefill=True,
          # Dtype the servers hold the policy in ("" = model.param_dtype):
          # bfloat16 halves rollout memory; snapshots are cast on restore.
          param_dtype="",
          # Server mode (role=rollout / learner with remote servers).
          port=9000,
          server_addresses="",  # comma-separated host:port; empty = embedded servers
          # Server liveness is judged by health checks and token progress, never
          # by a per-request deadline (long generations are normal): a server is
          # down after unhealthy_after_s without a successful health check (a
          # hung or SIGSTOPped process), or after stall_timeout_s without a new
          # token while it has requests (0 = no stall check; keep it above the
          # longest compile when precompile is off). Its requests are re-issued
          # elsewhere; it is re-admitted when it answers again.
          health_interval_s=5.0,
          unhealthy_after_s=30.0,
          stall_timeout_s=300.0,
          control_timeout_s=10.0,  # deadline of Status / Abort / Health calls
          load_timeout_s=600.0,  # deadline of one LoadVersion (and of start-up)
      )
  )

  c.snapshots = ml_collections.ConfigDict(
      # directory "" = <output_dir>/snapshots. max_to_keep 0 = keep every
      # version (benchmarks/time_to_reward.py evaluates them after the run).
      dict(directory="", max_to_keep=4)
  )

  c.orchestrator = ml_collections.ConfigDict(
      dict(
          max_staleness=2,
          # Requests in flight per server beyond its slots (keeps slots full).
          queue_depth=4,
          # A rollout server that dies and comes back at the same address
          # (a new process), or stalls, is re-admitted this many times; then
          # retired. A blip (the same process answering again) costs nothing.
          max_server_restarts=3,
          # With no live rollout server, requests wait this long for one to
          # come back before the run fails.
          no_server_grace_s=1800.0,
          # async_unfiltered / dora / dora_pace: the learner only copies its
          # params and goes on training while the Orbax write (and the
          # servers' load) runs in the background; versions produced meanwhile
          # are coalesced to the newest. sync / one_step_off / partial_rollout
          # always publish before generating again.
          async_publish=True,
          # Streaming modes keep in flight only what the servers' slots and
          # queues can work on. True fills AReaL's whole staleness budget
          # ((max_staleness + 1) batches) instead, so high max_staleness is
          # actually reached (benchmarks/staleness_sweep.py).
          fill_staleness_budget=False,
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

  # Rewards by name (jax_dora.rewards): "task" scores synthetic prompts with
  # their own verifier; "math_verify" checks the final answer of math
  # datasets; "format" rewards a well-formed final answer. Weighted sum.
  c.reward = ml_collections.ConfigDict(
      dict(
          functions="task",
          weights="",  # comma-separated, same order; empty = all 1.0
          # Verifiers that parse model output run in worker processes, each
          # answer with this deadline: a pathological completion scores 0
          # (counted in the metrics) instead of hanging the run.
          timeout_s=5.0,
          num_workers=2,
          # DAPO's soft overlong punishment: completions longer than
          # max_new_tokens - overlong_buffer lose up to overlong_penalty,
          # linearly over the buffer (0 = off).
          overlong_buffer=0,
          overlong_penalty=1.0,
      )
  )

  c.checkpoint = ml_collections.ConfigDict(
      dict(every_steps=0, max_to_keep=2, resume=True)  # 0 = only at the end
  )

  # Held-out evaluation. num_samples = k completions per prompt: the log gets
  # pass@1, pass@k and maj@k (with standard errors) beside the mean reward. A
  # completion is correct when its reward >= correct_threshold (the synthetic
  # tasks give partial credit; 1.0 = exact). greedy: argmax decoding, for
  # ``python -m jax_dora.evaluate`` only (it starts its own servers; the
  # in-training eval shares the rollout servers, which sample at
  # rollout.temperature).
  c.eval = ml_collections.ConfigDict({
      "every_steps": 10, "num_prompts": 64, "at_start": True, "num_samples": 1,
      "correct_threshold": 1.0, "greedy": False})

  # Where the per-step records go besides metrics.jsonl (always written: the
  # audit, the benchmarks and jax_dora.report read it). TensorBoard event
  # files in <output_dir>/tensorboard; W&B when wandb_project is set
  # (wandb_mode=offline needs no network: `wandb sync` uploads later).
  # num_text_samples decoded completions are logged as text every
  # text_every_steps steps (0 = never).
  c.metrics = ml_collections.ConfigDict({
      "tensorboard": True, "wandb_project": "", "wandb_entity": "", "wandb_mode": "online",
      "num_text_samples": 4, "text_every_steps": 10})

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


def hf_model_config(hf_path: str = "", **run_fields) -> ml_collections.ConfigDict:
  """A ``model`` block for a Hugging Face checkpoint: architecture from its config.json.

  Every architecture field is an unset placeholder; setting one on the
  command line is allowed only if it agrees with the checkpoint (a mismatch
  is an error, never a silent reshape). ``run_fields`` sets ``max_seq_len``,
  ``param_dtype`` and ``dtype``.
  """
  from ml_collections import config_dict  # pylint: disable=g-import-not-at-top

  from jax_dora.model.hf_checkpoint import RUN_LEVEL_FIELDS  # pylint: disable=g-import-not-at-top

  run_level = ("hf_path", *RUN_LEVEL_FIELDS)
  block = ml_collections.ConfigDict({
      k: v if k in run_level else config_dict.placeholder(type(v))
      for k, v in base_config().model.items()
  })
  block.hf_path = hf_path
  block.update(run_fields)
  return block


def validate(c: ml_collections.ConfigDict) -> None:
  """Raises :class:`ConfigError` with an actionable message on bad values."""
  if c.mode not in MODES:
    raise ConfigError(f"config.mode={c.mode!r} is not one of {MODES}")
  if c.role not in ("all", "learner", "rollout"):
    raise ConfigError(f"config.role={c.role!r} must be all, learner or rollout")
  if c.role == "learner" and not str(c.rollout.server_addresses).strip():
    raise ConfigError("config.role=learner needs config.rollout.server_addresses (host:port of the"
                      " rollout servers); role=all runs embedded servers instead")
  if c.role == "all" and str(c.rollout.server_addresses).strip():
    raise ConfigError("config.rollout.server_addresses is set but config.role=all runs embedded"
                      " rollout servers; set config.role=learner to use the remote servers")
  if not c.rollout.temperature > 0:
    raise ConfigError(f"config.rollout.temperature={c.rollout.temperature} must be > 0: the learner"
                      " scores trajectories under logits / temperature (greedy decoding is not a"
                      " sampling policy GRPO can train on)")
  if not 0 < c.rollout.top_p <= 1:
    raise ConfigError(f"config.rollout.top_p={c.rollout.top_p} must be in (0, 1]")
  r = c.rollout
  if min(r.health_interval_s, r.unhealthy_after_s, r.control_timeout_s, r.load_timeout_s) <= 0 or (
      r.stall_timeout_s < 0):
    raise ConfigError("config.rollout.health_interval_s, unhealthy_after_s, control_timeout_s and"
                      " load_timeout_s must be > 0 (stall_timeout_s >= 0)")
  if c.orchestrator.max_server_restarts < 0 or c.orchestrator.no_server_grace_s <= 0:
    raise ConfigError("config.orchestrator.max_server_restarts must be >= 0 and no_server_grace_s > 0")
  if c.log_every < 0:
    raise ConfigError("config.log_every must be >= 0")
  if c.learner.group_size < 2:
    raise ConfigError("config.learner.group_size must be >= 2 for GRPO advantages")
  if c.orchestrator.max_staleness < 0:
    raise ConfigError("config.orchestrator.max_staleness must be >= 0")
  if c.rollout.decode_attention not in ("blocked", "dense"):
    raise ConfigError(f"config.rollout.decode_attention={c.rollout.decode_attention!r} is not one"
                      " of ('blocked', 'dense')")
  if c.rollout.attention_block < 0 or c.rollout.prefill_batch_tokens < 1:
    raise ConfigError("config.rollout.attention_block must be >= 0 and prefill_batch_tokens >= 1")
  try:
    if any(b < 1 for b in split_csv(c.rollout.decode_length_buckets, int)):
      raise ValueError("every bucket must be >= 1")
  except ValueError as e:
    raise ConfigError(
        f"config.rollout.decode_length_buckets={c.rollout.decode_length_buckets!r}: {e}") from e
  if c.rollout.max_versions < 1:
    raise ConfigError("config.rollout.max_versions must be >= 1")
  need = c.rollout.max_prefill_length + c.rollout.max_new_tokens
  if need > c.model.max_seq_len:
    raise ConfigError(
        f"rollout.max_prefill_length + rollout.max_new_tokens = {need} exceeds"
        f" model.max_seq_len = {c.model.max_seq_len}"
    )
  synthetic = not str(c.data.train_files).strip()
  if synthetic and c.data.max_answer_len + 1 > c.rollout.max_new_tokens:
    raise ConfigError(
        f"data.max_answer_len={c.data.max_answer_len} needs rollout.max_new_tokens >="
        f" {c.data.max_answer_len + 1} (answer + EOS)"
    )
  if synthetic and c.data.max_prompt_len + 1 > c.rollout.max_prefill_length:
    raise ConfigError(
        f"data.max_prompt_len={c.data.max_prompt_len} needs rollout.max_prefill_length >="
        f" {c.data.max_prompt_len + 1} (prompt + BOS)"
    )
  if c.data.prompt_template not in ("raw", "chat"):
    raise ConfigError(f"config.data.prompt_template={c.data.prompt_template!r} must be raw or chat")
  if c.data.prompt_template == "chat" and not c.model.hf_path:
    raise ConfigError("config.data.prompt_template=chat needs model.hf_path (a tokenizer with a"
                      " chat template); the native character model takes raw prompts")
  if c.data.on_bad_row not in ("skip", "error"):
    raise ConfigError(f"config.data.on_bad_row={c.data.on_bad_row!r} must be skip or error")
  if not c.model.hf_path:
    missing = [k for k, v in c.model.items() if v is None]
    if missing:
      raise ConfigError(f"config.model.{missing[0]} is unset: set model.hf_path to take the"
                        " architecture from a Hugging Face checkpoint, or set the field")
  from jax_dora.rewards import reward_names  # pylint: disable=g-import-not-at-top

  names = split_csv(c.reward.functions)
  unknown = [n for n in names if n not in reward_names()]
  if not names or unknown:
    raise ConfigError(f"config.reward.functions={c.reward.functions!r}: unknown {unknown or '(empty)'};"
                      f" known rewards: {reward_names()}")
  if not synthetic and "task" in names:
    raise ConfigError("config.reward.functions includes 'task', which scores the synthetic tasks;"
                      " dataset files need a reward such as math_verify")
  weights = split_csv(c.reward.weights)
  if weights and len(weights) != len(names):
    raise ConfigError(f"config.reward.weights has {len(weights)} entries for {len(names)} functions")
  if c.reward.timeout_s <= 0:
    raise ConfigError("config.reward.timeout_s must be > 0")
  if c.learner.micro_batch_size < 0 or c.learner.logprob_chunk_size < 0:
    raise ConfigError("config.learner.micro_batch_size and logprob_chunk_size must be >= 0")
  batch = c.learner.groups_per_step * c.learner.group_size
  if c.learner.micro_batch_size and batch % c.learner.micro_batch_size:
    raise ConfigError(f"config.learner.micro_batch_size={c.learner.micro_batch_size} does not"
                      f" divide the batch of {batch} trajectories (groups_per_step x group_size)")
  from jax_dora.model.transformer import REMAT_POLICIES  # pylint: disable=g-import-not-at-top

  if c.learner.remat not in REMAT_POLICIES:
    raise ConfigError(f"config.learner.remat={c.learner.remat!r} is not one of {sorted(REMAT_POLICIES)}")
  for name, value in (("model.param_dtype", c.model.param_dtype), ("model.dtype", c.model.dtype),
                      ("rollout.param_dtype", c.rollout.param_dtype or "float32")):
    try:
      np.dtype(jnp.dtype(value))
    except TypeError:
      raise ConfigError(f"config.{name}={value!r} is not a dtype name") from None
  dps = c.rollout.devices_per_server
  if c.rollout.tensor_parallel < 1 or (dps > 0 and dps % c.rollout.tensor_parallel):
    raise ConfigError(f"config.rollout.tensor_parallel={c.rollout.tensor_parallel} must divide"
                      f" rollout.devices_per_server={c.rollout.devices_per_server}")
  try:
    from jax_dora.learner.batching import parse_buckets  # pylint: disable=g-import-not-at-top

    parse_buckets(str(c.learner.seq_len_buckets), c.model.max_seq_len)
  except ValueError as e:
    raise ConfigError(f"config.learner.seq_len_buckets={c.learner.seq_len_buckets!r}: {e}") from e
  if c.distributed.num_learner_processes == 0 or c.distributed.num_learner_processes < -1:
    raise ConfigError("config.distributed.num_learner_processes must be -1 (all) or >= 1")
  if c.rollout.length_mode not in LENGTH_MODES:
    raise ConfigError(f"config.rollout.length_mode={c.rollout.length_mode!r} is not one of {LENGTH_MODES}")
  _validate_loss(c)
  if c.pace.on_reject not in ("regenerate", "drop"):
    raise ConfigError("config.pace.on_reject must be 'regenerate' or 'drop'")
  if c.snapshots.max_to_keep < 0:
    raise ConfigError(f"config.snapshots.max_to_keep={c.snapshots.max_to_keep} must be >= 1,"
                      " or 0 to keep every version")
  if c.eval.num_samples < 1:
    raise ConfigError(f"config.eval.num_samples={c.eval.num_samples} must be >= 1 (k of pass@k)")
  if c.metrics.wandb_mode not in ("online", "offline", "disabled"):
    raise ConfigError(f"config.metrics.wandb_mode={c.metrics.wandb_mode!r} must be online,"
                      " offline or disabled")
  if c.metrics.num_text_samples < 0 or c.metrics.text_every_steps < 0:
    raise ConfigError("config.metrics.num_text_samples and text_every_steps must be >= 0")


def _validate_loss(c: ml_collections.ConfigDict) -> None:
  """The learner's loss choices (names from the registries, numeric ranges)."""
  from jax_dora.learner import losses  # pylint: disable=g-import-not-at-top

  lc = c.learner
  for key, registry in (("loss", losses.OBJECTIVES), ("is_correction", losses.CORRECTIONS),
                        ("loss_aggregation", losses.AGGREGATIONS),
                        ("advantage_estimator", losses.ADVANTAGES)):
    if lc[key] not in registry.names():
      raise ConfigError(f"config.learner.{key}={lc[key]!r} is not one of {registry.names()}")
  if lc.is_level not in ("token", "sequence"):
    raise ConfigError(f"config.learner.is_level={lc.is_level!r} must be token or sequence")
  if lc.proximal_logprobs not in ("recompute", "loglinear"):
    raise ConfigError(f"config.learner.proximal_logprobs={lc.proximal_logprobs!r} must be"
                      " recompute or loglinear")
  if not lc.tis_cap > 0 or not 0 <= lc.mis_low < lc.mis_high:
    raise ConfigError("config.learner.tis_cap must be > 0 and 0 <= mis_low < mis_high")
  if min(lc.clip_eps, lc.clip_eps_high, lc.gspo_clip_eps, lc.gspo_clip_eps_high,
         lc.cispo_clip_high) < 0 or lc.loss_norm_length < 0:
    raise ConfigError("config.learner clip ranges and loss_norm_length must be >= 0")
  batch = lc.groups_per_step * lc.group_size
  if lc.ppo_minibatches < 1 or batch % lc.ppo_minibatches:
    raise ConfigError(f"config.learner.ppo_minibatches={lc.ppo_minibatches} must be >= 1 and"
                      f" divide the batch of {batch} trajectories")
  mini = batch // lc.ppo_minibatches
  if lc.micro_batch_size and lc.micro_batch_size < mini and mini % lc.micro_batch_size:
    raise ConfigError(f"config.learner.micro_batch_size={lc.micro_batch_size} does not divide"
                      f" a minibatch of {mini} trajectories (batch / ppo_minibatches)")
  if lc.group_micro_batches_by_length and not lc.micro_batch_size:
    raise ConfigError("config.learner.group_micro_batches_by_length needs"
                      " config.learner.micro_batch_size > 0 (the rows of one micro-batch)")
  if lc.dynamic_sampling_max_draws < 1:
    raise ConfigError("config.learner.dynamic_sampling_max_draws must be >= 1")
  if lc.mask_truncated and c.rollout.length_mode == "answer":
    raise ConfigError("config.learner.mask_truncated would mask every completion with"
                      " rollout.length_mode=answer (each stops at its length budget)")
  r = c.reward
  if not 0 <= r.overlong_buffer < c.rollout.max_new_tokens or r.overlong_penalty < 0:
    raise ConfigError(f"config.reward.overlong_buffer={r.overlong_buffer} must be in"
                      f" [0, rollout.max_new_tokens={c.rollout.max_new_tokens}) and"
                      " overlong_penalty >= 0")
