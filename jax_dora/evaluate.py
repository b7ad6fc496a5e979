"""Evaluates saved policy versions: ``python -m jax_dora.evaluate --run_dir=DIR [--step=N | --steps=A,B,..]``.

``--config=configs/X.py`` instead evaluates the checkpoint a config starts
from (``model.hf_path``, e.g. the shipped base model) on that config's
held-out prompts, with no run directory: the weights are published once as
version 0 in a temporary snapshot directory and served the same way.
``--group_field=difficulty`` splits every metric by that field of the
held-out rows (``eval/difficulty=3/pass@1``).

Rebuilds the run from ``DIR/config.json`` (model, tokenizer, held-out
prompts, reward), starts embedded rollout servers on the snapshot of version
``N`` (default: the newest in the run's snapshot directory) and reports mean
reward, pass@1, pass@k and maj@k with standard errors over the held-out
prompts (:mod:`jax_dora.metrics.passk`). The result is printed and written
to ``DIR/eval_step<N>.json``. ``--steps`` evaluates several versions with one
set of servers (start-up and compilation paid once) and writes
``DIR/eval_steps.json``: how ``benchmarks/time_to_reward.py`` draws a
reward-vs-wall-clock curve from a finished run's kept snapshots without the
evaluation ever running inside the run's clock.

Unlike the in-training eval, which shares the training servers and samples
at ``rollout.temperature``, this command owns its servers, so ``--greedy``
decodes with argmax (pass@k then equals pass@1: the k samples agree).
"""

from __future__ import annotations

import json
import os
import sys

if __name__ == "__main__":
  from jax_dora.runtime import cpu_friendly_env  # pylint: disable=g-import-not-at-top

  cpu_friendly_env()

from absl import app, flags  # pylint: disable=g-import-not-at-top
from ml_collections import config_flags  # pylint: disable=g-import-not-at-top

_RUN_DIR = flags.DEFINE_string("run_dir", None, "A run's output_dir (holds config.json).")
_STEP = flags.DEFINE_integer("step", None, "Policy version to evaluate (default: the newest).")
_STEPS = flags.DEFINE_list("steps", None, "Several versions, evaluated in this order with the same"
                           " servers and prompts (writes eval_steps.json).")
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", None, "k samples per prompt (default: the"
                                    " run's eval.num_samples).")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", None, "Held-out prompts (default: the run's"
                                    " eval.num_prompts).")
_GREEDY = flags.DEFINE_boolean("greedy", None, "Argmax decoding (default: the run's eval.greedy).")
# ``--config`` is defined by run(), the command line's entry, not at import: the library
# functions here are imported beside other modules whose commands define a --config of their
# own (jax_dora.rollout.server_main, jax_dora.train), and absl refuses a flag defined twice.
_CONFIG = None


def _define_config_flag() -> None:
  global _CONFIG
  if _CONFIG is None:
    _CONFIG = config_flags.DEFINE_config_file(
        "config", None, "A config file (configs/*.py) whose model.hf_path is evaluated on its"
        " held-out prompts, instead of --run_dir (--config.x=y overrides).", lock_config=False)
_GROUP_FIELD = flags.DEFINE_string("group_field", None, "Held-out row field that splits the"
                                   " metrics (data.eval_group_field), e.g. difficulty.")
_OUT = flags.DEFINE_string("out", None, "Where the JSON result goes (default: in --run_dir).")


class EvaluateError(ValueError):
  """The run directory or the requested version cannot be evaluated."""


def load_run_config(run_dir: str):
  """The run's config (``config.json``), unlocked so evaluation settings can change."""
  import ml_collections  # pylint: disable=g-import-not-at-top

  path = os.path.join(run_dir, "config.json")
  if not os.path.exists(path):
    raise EvaluateError(f"{run_dir}: no config.json (is it a run's output_dir?)")
  with open(path) as f:
    return ml_collections.ConfigDict(json.load(f))


def snapshot_dir(cfg, run_dir: str) -> str:
  return cfg.snapshots.directory or os.path.join(run_dir, "snapshots")


def evaluate_run(run_dir: str, step: int | None = None, *, num_samples: int | None = None,
                 num_prompts: int | None = None, greedy: bool | None = None) -> dict:
  """Evaluates version ``step`` of the run in ``run_dir``; returns the metrics."""
  return evaluate_versions(run_dir, [step], num_samples=num_samples, num_prompts=num_prompts,
                           greedy=greedy)[0]


def _eval_config(raw, *, num_samples: int | None, num_prompts: int | None, greedy: bool | None,
                 group_field: str | None = None):
  """The typed config of an evaluation: embedded servers, the eval overrides applied."""
  from jax_dora.config import validate  # pylint: disable=g-import-not-at-top

  raw = raw.copy_and_resolve_references()  # the caller's (possibly locked) config is left as it is
  raw.unlock()
  raw.role, raw.rollout.server_addresses = "all", ""  # its own embedded servers
  for key, value in (("num_samples", num_samples), ("num_prompts", num_prompts),
                     ("greedy", greedy)):
    if value is not None:
      raw.eval[key] = value
  if group_field is not None:
    raw.data.eval_group_field = group_field
  cfg = validate(raw)
  if cfg.eval.num_prompts < 1:
    raise EvaluateError("no held-out prompts: pass --num_prompts")
  return cfg


def evaluate_checkpoint(config, *, num_samples: int | None = None, num_prompts: int | None = None,
                        greedy: bool | None = None, group_field: str | None = None) -> dict:
  """Evaluates ``config``'s ``model.hf_path`` checkpoint on its held-out prompts.

  The checkpoint is read onto one device and published as version 0 in a
  temporary snapshot directory, which the embedded servers load like any
  run's snapshot.
  """
  import tempfile  # pylint: disable=g-import-not-at-top

  import jax  # pylint: disable=g-import-not-at-top

  from jax_dora.policy import resolve_policy  # pylint: disable=g-import-not-at-top
  from jax_dora.snapshots import SnapshotPublisher  # pylint: disable=g-import-not-at-top

  cfg = _eval_config(config, num_samples=num_samples, num_prompts=num_prompts, greedy=greedy,
                     group_field=group_field)
  policy = resolve_policy(cfg)
  if policy.checkpoint is None:
    raise EvaluateError("--config evaluates model.hf_path: this config has none (a native model"
                        " has no weights before training; evaluate a run with --run_dir)")
  params = policy.load_params(jax.sharding.SingleDeviceSharding(jax.devices()[0]))
  with tempfile.TemporaryDirectory(prefix="jax_dora_eval_") as snaps:
    publisher = SnapshotPublisher(snaps)
    publisher.publish(0, params, {"step": 0})
    publisher.close()
    del params
    return _evaluate_snapshots(cfg, snaps, [0], policy)[0]


def evaluate_versions(run_dir: str, steps: list[int | None], *, num_samples: int | None = None,
                      num_prompts: int | None = None, greedy: bool | None = None,
                      group_field: str | None = None) -> list[dict]:
  """Evaluates each version in ``steps`` (``None``: the newest) on the same
  held-out prompts with one set of servers; returns one metrics dict per step."""
  from jax_dora.snapshots.store import SnapshotReader  # pylint: disable=g-import-not-at-top

  cfg = _eval_config(load_run_config(run_dir), num_samples=num_samples, num_prompts=num_prompts,
                     greedy=greedy, group_field=group_field)
  snaps = snapshot_dir(cfg, run_dir)
  versions = SnapshotReader(snaps).versions() if os.path.isdir(snaps) else []
  if not versions:
    raise EvaluateError(f"{snaps}: no snapshot to evaluate")
  steps = [versions[-1] if step is None else int(step) for step in steps]
  missing = [step for step in steps if step not in versions]
  if missing:
    raise EvaluateError(f"version(s) {missing} not in {snaps} (kept: {versions};"
                        " snapshots.max_to_keep prunes older ones; 0 keeps all)")
  return _evaluate_snapshots(cfg, snaps, steps)


def _evaluate_snapshots(cfg, snaps: str, steps: list[int], policy=None) -> list[dict]:
  """Every version in ``steps`` of the snapshot directory ``snaps``, with one set of servers."""
  import dataclasses  # pylint: disable=g-import-not-at-top

  import jax  # pylint: disable=g-import-not-at-top

  from jax_dora.data import make_eval_prompts  # pylint: disable=g-import-not-at-top
  from jax_dora.orchestrator.evaluation import Evaluator, length_budget  # pylint: disable=g-import-not-at-top
  from jax_dora.orchestrator.multiturn import ToolLoop  # pylint: disable=g-import-not-at-top
  from jax_dora.policy import resolve_policy  # pylint: disable=g-import-not-at-top
  from jax_dora.runtime import build_rollout_side, run_async  # pylint: disable=g-import-not-at-top

  if cfg.eval.greedy:
    # The engine's argmax (after validate, which refuses temperature 0 for training).
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, temperature=0.0))
  policy = policy or resolve_policy(cfg)
  tokenizer = policy.tokenizer
  prompts = make_eval_prompts(cfg, cfg.eval.num_prompts, tokenizer)
  rollout = build_rollout_side(cfg, snaps, list(jax.devices()), policy)
  dispatcher = rollout.dispatcher
  evaluator = Evaluator(
      prompts, dispatcher, rollout.scorer, tokenizer,
      lambda p: length_budget(tokenizer, cfg.rollout.max_new_tokens,
                              cfg.rollout.length_mode == "answer", p),
      num_samples=cfg.eval.num_samples, correct_threshold=cfg.eval.correct_threshold,
      tool_loop=ToolLoop.from_config(cfg.tools, rollout.tools, tokenizer))

  results: list[dict] = []

  async def main() -> None:
    try:
      for step in steps:
        await dispatcher.broadcast_version(step)
        await evaluator.evaluate()
        results.append(
            {"step": step, "num_prompts": len(prompts), "num_samples": cfg.eval.num_samples,
             "greedy": cfg.eval.greedy, **evaluator.last_metrics,
             "samples": [{"sample_id": sid, "member": m, "completion": text, "reward": r}
                         for sid, m, text, r in evaluator.last_samples]})
    finally:
      await rollout.close()

  run_async(main)
  return results


def _print(out: dict, path: str) -> None:
  print(f"version {out['step']}: {out['num_prompts']} prompts x {out['num_samples']} samples"
        f" ({'greedy' if out['greedy'] else 'sampled'})")
  for key, value in out.items():
    if key.startswith("eval/") and not key.endswith("_stderr") and value is not None:
      se = out.get(f"{key}_stderr")
      print(f"  {key.removeprefix('eval/'):<22} {value:.3f}" + (f" ± {se:.3f}" if se is not None
                                                                  else ""))
  print(path)


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if bool(_RUN_DIR.value) == (_CONFIG.value is not None):
    raise app.UsageError("pass --run_dir (a run's versions) or --config (its model.hf_path)")
  from jax_dora.quiet import quiet_startup  # pylint: disable=g-import-not-at-top

  quiet_startup(verbose=flags.FLAGS["verbosity"].present and flags.FLAGS["verbosity"].value >= 1)
  from jax_dora.config import ConfigError, RunConfig  # pylint: disable=g-import-not-at-top
  from jax_dora.data import DatasetError  # pylint: disable=g-import-not-at-top
  from jax_dora.model.hf_checkpoint import CheckpointError  # pylint: disable=g-import-not-at-top
  from jax_dora.runtime import configure_logging  # pylint: disable=g-import-not-at-top

  configure_logging(flags.FLAGS["verbosity"].value if flags.FLAGS["verbosity"].present else None,
                    progress_bar=False)
  from jax_dora.compile_cache import setup_compile_cache  # pylint: disable=g-import-not-at-top

  overrides = dict(num_samples=_NUM_SAMPLES.value, num_prompts=_NUM_PROMPTS.value,
                   greedy=_GREEDY.value, group_field=_GROUP_FIELD.value)
  try:
    if _CONFIG.value is not None:
      setup_compile_cache(RunConfig.of(_CONFIG.value).compile_cache_dir)
      out = evaluate_checkpoint(_CONFIG.value, **overrides)
      path = _OUT.value or os.path.join(_CONFIG.value.output_dir, "eval_checkpoint.json")
      os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
      with open(path, "w") as f:
        json.dump(out, f, indent=2)
      _print(out, path)
      return
    # The run's cache setting (older runs' configs lack the key: the default).
    setup_compile_cache(RunConfig.of(load_run_config(_RUN_DIR.value)).compile_cache_dir)
    if _STEPS.value and _STEP.value is not None:
      raise EvaluateError("pass --step or --steps, not both")
    try:
      steps = [int(s) for s in _STEPS.value] if _STEPS.value else [_STEP.value]
    except ValueError as e:
      raise EvaluateError(f"--steps must be integers: {_STEPS.value}") from e
    outs = evaluate_versions(_RUN_DIR.value, steps, **overrides)
  except (EvaluateError, ConfigError, CheckpointError, DatasetError) as e:
    print(f"evaluate error: {e}", file=sys.stderr)
    sys.exit(2)
  if _STEPS.value:
    path = _OUT.value or os.path.join(_RUN_DIR.value, "eval_steps.json")
    with open(path, "w") as f:
      json.dump(outs, f, indent=1)  # with every completion, as --step and --config write
    for o in outs:
      print(f"version {o['step']}: mean reward {o.get('eval/reward', float('nan')):.3f}")
    print(path)
    return
  out = outs[0]
  path = _OUT.value or os.path.join(_RUN_DIR.value, f"eval_step{out['step']}.json")
  with open(path, "w") as f:
    json.dump(out, f, indent=2)
  _print(out, path)


def run() -> None:
  from jax_dora.runtime import cpu_friendly_env  # pylint: disable=g-import-not-at-top

  cpu_friendly_env()
  _define_config_flag()
  app.run(main)


if __name__ == "__main__":
  run()
