"""Supervised fine-tuning with the RL learner: a loss and a data path, not a second trainer.

What a cold-start SFT needs (verl's SFT trainer, Tunix's SFT, slime's
cold start), built from the parts RL already trusts:

* the policy comes from ``model.hf_path`` (``jax_dora.policy``), the learner
  is :class:`jax_dora.learner.train_state.Learner` with ``learner.loss=sft``
  (masked cross-entropy through the same jitted step, sharding,
  micro-batching, length grouping, remat and chunked log-probs);
* rows come from ``data.train_files`` through :mod:`jax_dora.data.sft` (the
  RL file formats and chat template; a checkpointable Grain stream);
* every ``eval.every_steps`` steps: the held-out token loss
  (``sft.eval_loss_rows`` rows of ``data.eval_files``, the training forward)
  and greedy accuracy on ``eval.num_prompts`` held-out prompts, decoded by
  embedded rollout servers (the real engine) from a published Orbax
  snapshot and scored by the run's reward (``reward.functions``);
* the run directory has RL's layout (``config.json``, ``model_config.json``,
  ``snapshots/``, ``checkpoints/``, ``metrics.jsonl``, TensorBoard), so
  ``jax_dora.evaluate``, ``jax_dora.export`` and resume work on it as on an RL
  run; at the end the policy is written as a Hugging Face checkpoint
  (``sft.export_dir``) that ``model.hf_path`` and ``transformers`` load.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
from typing import Any

import jax
import ml_collections
import numpy as np

from jax_dora.config import ConfigError, RunConfig, validate
from jax_dora.data import make_eval_prompts
from jax_dora.data.sft import (ObservationSpans, SftRows, SftStream, bucket_length, pack_batch,
                               read_sft_table, tokenize_rows)
from jax_dora.learner.batching import parse_buckets
from jax_dora.learner.mesh import BATCH_AXES, make_mesh, split_devices
from jax_dora.learner.train_state import Learner
from jax_dora.metrics.writers import open_run_metrics
from jax_dora.orchestrator.evaluation import Evaluator, length_budget
from jax_dora.orchestrator.multiturn import FORMATS, ToolLoop
from jax_dora.orchestrator.run_checkpoint import RunCheckpointer
from jax_dora.policy import PolicySpec, resolve_policy
from jax_dora.runtime import (
  RunPaths,
  build_rollout_side,
  new_incarnation,
  run_async,
  setup_logging,
  write_run_metadata,
)
from jax_dora.snapshots import SnapshotPublisher

log = logging.getLogger("jax_dora.sft")


def observation_spans_of(cfg: RunConfig) -> ObservationSpans | None:
  """Where the run's tool observations sit in an SFT target (None: no tool configured)."""
  return FORMATS.get(cfg.tools.name).observation_spans if cfg.tools.enabled else None


def check_sft_config(cfg: ml_collections.ConfigDict | RunConfig) -> RunConfig:
  """:func:`validate` plus what SFT needs: the sft loss, files and a batch the mesh divides."""
  cfg = validate(cfg)
  if cfg.learner.loss != "sft":
    raise ConfigError(f"SFT trains with learner.loss=sft (got {cfg.learner.loss!r}): the"
                      " cross-entropy of the target tokens")
  if not cfg.data.uses_files:
    raise ConfigError("SFT needs data.train_files (JSONL/Parquet rows with a prompt and a target)")
  if cfg.eval.num_prompts and not cfg.data.eval_files:
    raise ConfigError("SFT's held-out accuracy needs data.eval_files (eval.num_prompts=0 turns"
                      " it off)")
  if cfg.learner.ppo_minibatches != 1 or cfg.learner.kl_coef:
    raise ConfigError("SFT takes one update per batch without a reference model"
                      " (learner.ppo_minibatches=1, learner.kl_coef=0)")
  return cfg


@dataclasses.dataclass
class HeldOut:
  """What an SFT eval measures: held-out rows for the loss, prompts for greedy accuracy."""

  rows: SftRows | None
  evaluator: Evaluator | None


class SftRun:
  """One SFT run's parts (built by :func:`build_sft_run`); :meth:`train` runs it."""

  def __init__(self, cfg: RunConfig, paths: RunPaths, policy: PolicySpec, learner: Learner,
               stream: SftStream, checkpointer: RunCheckpointer, publisher: SnapshotPublisher,
               rollout_devices: list[jax.Device], resumed_step: int | None,
               n_train_rows: int, skipped: dict[str, int]):
    self.cfg, self.paths, self.policy, self.learner = cfg, paths, policy, learner
    self.stream, self.checkpointer, self.publisher = stream, checkpointer, publisher
    self.rollout_devices = rollout_devices
    self.resumed_step = resumed_step
    self.n_train_rows = n_train_rows
    self.skipped = skipped
    self.buckets = parse_buckets(cfg.learner.seq_len_buckets, cfg.model.max_seq_len)
    self.template = {b: learner.batch_template(cfg.sft.batch_size, b) for b in self.buckets}

  # -- data -------------------------------------------------------------------
  def _batch(self, rows: list[tuple[np.ndarray, int]]) -> dict[str, np.ndarray]:
    return pack_batch(rows, self.template[bucket_length(rows, self.buckets)],
                      self.policy.tokenizer.pad_id)

  # -- evaluation -------------------------------------------------------------
  def heldout_loss(self, rows: SftRows) -> float:
    """Mean cross-entropy per target token over ``rows`` under the live parameters."""
    total, count = 0.0, 0.0
    n = self.cfg.sft.batch_size
    for start in range(0, len(rows), n):
      chunk = [rows[i] for i in range(start, min(start + n, len(rows)))]
      batch = self._batch(chunk)
      logp = self.learner.logprobs_under(self.learner.params, batch)
      total -= float((logp * batch["mask"]).sum())
      count += float(batch["mask"].sum())
    return total / max(count, 1.0)

  async def _evaluate(self, held: HeldOut, dispatcher: Any, step: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if held.rows is not None:
      out["sft/heldout_loss"] = await asyncio.to_thread(self.heldout_loss, held.rows)
    if held.evaluator is not None:
      await asyncio.to_thread(self.publisher.publish, step, self.learner.params, {"step": step})
      await dispatcher.broadcast_version(step)
      await held.evaluator.evaluate()
      for key, value in held.evaluator.last_metrics.items():
        if value is not None:
          out[key.replace("eval/", "sft/greedy_", 1)] = value
    return out

  # -- the loop ---------------------------------------------------------------
  def train(self) -> dict[str, Any]:
    """Trains ``total_steps`` steps (or ``max_wall_time_s``), exports; returns the summary."""
    cfg, paths = self.cfg, self.paths
    tokenizer = self.policy.tokenizer
    held_rows = None
    if cfg.sft.eval_loss_rows and cfg.data.eval_files:
      table = read_sft_table(cfg, cfg.data.eval_files)
      rows = tokenize_rows(table, tokenizer, cfg.model.max_seq_len, cfg.data.on_bad_row,
                           observation_spans_of(cfg))
      keep = np.random.default_rng(cfg.data.eval_seed).permutation(len(rows))[:cfg.sft.eval_loss_rows]
      held_rows = rows.subset(keep)
    rollout = None
    evaluator = None
    if cfg.eval.num_prompts:
      # Greedy decoding on servers of their own (like `jax_dora.evaluate --greedy`):
      # the accuracy of the argmax policy, not of one temperature-1 draw.
      greedy = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, temperature=0.0))
      rollout = build_rollout_side(greedy, paths.snapshots, self.rollout_devices, self.policy)
      prompts = make_eval_prompts(cfg, cfg.eval.num_prompts, tokenizer)
      evaluator = Evaluator(
          prompts, rollout.dispatcher, rollout.scorer, tokenizer,
          lambda p: length_budget(tokenizer, cfg.rollout.max_new_tokens, False, p),
          num_samples=1, correct_threshold=cfg.eval.correct_threshold,
          tool_loop=ToolLoop.from_config(cfg.tools, rollout.tools, tokenizer))
    held = HeldOut(held_rows, evaluator)
    metrics = open_run_metrics(cfg, paths.metrics, resumed_step=self.resumed_step,
                               incarnation=new_incarnation())
    progress = None
    if cfg.progress_bar:
      from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top

      progress = tqdm(total=cfg.total_steps, initial=self.learner.step, desc="sft",
                      dynamic_ncols=True, unit="step")
    history: list[dict[str, Any]] = []

    async def evaluate_into(rec: dict[str, Any]) -> dict[str, Any]:
      """Adds the held-out metrics at ``rec["step"]`` to ``rec``, logs and keeps it."""
      dispatcher = rollout.dispatcher if rollout is not None else None
      rec.update(await self._evaluate(held, dispatcher, rec["step"]))
      self._log_eval(rec)
      history.append(rec)
      return rec

    async def main() -> dict[str, Any]:
      learner = self.learner
      start, tokens_trained = time.time(), 0
      window = {"t": time.time(), "tokens": 0}
      first = learner.step
      try:
        if cfg.eval.at_start and first == 0:
          metrics.write(await evaluate_into({"step": 0}))
        while learner.step < cfg.total_steps:
          if cfg.max_wall_time_s and time.time() - start > cfg.max_wall_time_s:
            log.info("stopping at step %d: max_wall_time_s=%s reached", learner.step,
                     cfg.max_wall_time_s)
            break
          rows = self.stream.next_batch()
          batch = self._batch(rows)
          step_metrics = await asyncio.to_thread(learner.train_step, batch)
          step = learner.step
          n_tokens = int(batch["mask"].sum())
          tokens_trained += n_tokens
          window["tokens"] += n_tokens
          rec: dict[str, Any] = {"step": step, "sft/loss": step_metrics["loss"],
                                 "sft/grad_norm": step_metrics["grad_norm"],
                                 "sft/target_tokens": n_tokens,
                                 "sft/padded_positions": float(step_metrics["positions_computed"])}
          last = step == cfg.total_steps
          if cfg.log_every and step % cfg.log_every == 0:
            now = time.time()
            rec["sft/target_tokens_per_s"] = window["tokens"] / max(now - window["t"], 1e-9)
            window.update(t=now, tokens=0)
            log.info("step %d: loss %.4f, grad norm %.3f, %.0f target tok/s", step,
                     rec["sft/loss"], rec["sft/grad_norm"], rec["sft/target_tokens_per_s"])
          if (cfg.eval.every_steps and step % cfg.eval.every_steps == 0) or last:
            await evaluate_into(rec)
          metrics.write(rec)
          if progress is not None:
            progress.update(1)
            progress.set_postfix(loss=f"{rec['sft/loss']:.3f}")
          if (cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0) or last:
            self._checkpoint(metrics)
        if learner.step != (history[-1]["step"] if history else -1):
          metrics.write(await evaluate_into({"step": learner.step}))
          self._checkpoint(metrics)
      finally:
        if rollout is not None:
          await rollout.close()
      return {"steps": learner.step, "target_tokens": tokens_trained,
              "train_seconds": time.time() - start}

    try:
      with metrics:
        result = run_async(main)
    finally:
      if progress is not None:
        progress.close()
      self.publisher.close()
      self.checkpointer.close()
    export_dir = self.export()
    summary = {**result, "train_rows": self.n_train_rows, "rows_skipped": self.skipped,
               "evals": history, "export_dir": export_dir, "output_dir": str(paths.output_dir),
               "metrics_path": str(paths.metrics)}
    paths.summary.write_text(json.dumps(summary, indent=2, default=str))
    return summary

  @staticmethod
  def _log_eval(rec: dict[str, Any]) -> None:
    parts = [f"{k.removeprefix('sft/')} {v:.4f}" for k, v in sorted(rec.items())
             if k.startswith(("sft/heldout", "sft/greedy_pass@1", "sft/greedy_reward"))
             and not k.endswith("_stderr")]
    log.info("eval at step %d: %s", rec["step"], ", ".join(parts))

  def _checkpoint(self, metrics: Any) -> None:
    metrics.flush()
    step = self.learner.step
    self.checkpointer.save(step, self.learner.state, {"step": step, "data": self.stream.get_state()})

  def export(self) -> str:
    """The final policy as a Hugging Face checkpoint (``sft.export_dir``)."""
    from jax_dora.model.hf_export import export_hf  # pylint: disable=g-import-not-at-top

    out = self.cfg.sft.export_dir or str(self.paths.output_dir / "hf")
    export_hf(self.learner.params, self.policy.model_cfg, out, source_dir=self.policy.hf_path,
              dtype=self.cfg.sft.export_dtype, overwrite=True)
    log.info("exported the SFT policy (step %d, %s) to %s", self.learner.step,
             self.cfg.sft.export_dtype, out)
    return out


def build_sft_run(config: ml_collections.ConfigDict | RunConfig) -> SftRun:
  """Devices, policy, learner (loaded or resumed), the data stream and the stores."""
  cfg = check_sft_config(config)
  setup_logging()
  paths = RunPaths.from_config(cfg)
  policy = resolve_policy(cfg)
  if policy.checkpoint is None:
    raise ConfigError("SFT starts from a Hugging Face checkpoint (model.hf_path): a random"
                      " initial one is written by `python -m jax_dora.base_model`")
  n_rollout = cfg.rollout.num_servers * cfg.rollout.devices_per_server if cfg.eval.num_prompts else 0
  learner_devs, rollout_devs = split_devices(cfg.learner.num_devices, n_rollout, jax.devices())
  mesh = make_mesh(learner_devs, cfg.learner.mesh_data, cfg.learner.mesh_fsdp,
                   cfg.learner.mesh_tensor, cfg.learner.mesh_expert)
  batch_shards = math.prod(mesh.shape[a] for a in BATCH_AXES)
  if cfg.sft.batch_size % batch_shards:
    raise ConfigError(f"sft.batch_size={cfg.sft.batch_size} is not divisible by the"
                      f" {batch_shards} batch shards of the learner mesh {dict(mesh.shape)}")
  paths.output_dir.mkdir(parents=True, exist_ok=True)
  write_run_metadata(paths, cfg, policy)

  table = read_sft_table(cfg, cfg.data.train_files)
  rows = tokenize_rows(table, policy.tokenizer, cfg.model.max_seq_len, cfg.data.on_bad_row,
                       observation_spans_of(cfg))
  log.info("SFT data: %d rows of %s (%s)", len(rows), cfg.data.train_files,
           "nothing skipped" if not rows.skipped else f"skipped {rows.skipped}")
  stream = SftStream(rows, cfg.sft.batch_size, cfg.data.seed, cfg.data.num_epochs)

  checkpointer = RunCheckpointer(paths.checkpoints, cfg.checkpoint.max_to_keep)
  resumed_step = checkpointer.latest_step() if cfg.checkpoint.resume else None
  if not cfg.checkpoint.resume:
    checkpointer.discard_after(0)
  load = policy.load_params if resumed_step is None else None
  learner = Learner(policy.model_cfg, cfg.learner, mesh, temperature=1.0, seed=cfg.seed,
                    suppress_mask=policy.suppress_mask, load_params=load)
  if cfg.precompile:
    t0 = time.time()
    learner.warmup(cfg.sft.batch_size, parse_buckets(cfg.learner.seq_len_buckets,
                                                     cfg.model.max_seq_len))
    log.info("compiled the SFT step for every length bucket in %.1fs", time.time() - t0)
  if resumed_step is not None:
    learner.state, meta = checkpointer.restore(resumed_step, learner.state)
    stream.set_state(meta["data"])
    log.info("resumed SFT from step %d", resumed_step)
  # Every evaluated version is kept (a few MB each): `jax_dora.evaluate --steps` and
  # `jax_dora.export --step` can revisit any of them.
  publisher = SnapshotPublisher(paths.snapshots, max_to_keep=None, incarnation=new_incarnation())
  publisher.discard_after(learner.step - 1)
  return SftRun(cfg, paths, policy, learner, stream, checkpointer, publisher, rollout_devs,
                resumed_step, len(rows), rows.skipped)


def run_sft(config: ml_collections.ConfigDict | RunConfig) -> dict[str, Any]:
  """Builds and runs an SFT job described by ``config``; returns its summary."""
  return build_sft_run(config).train()
