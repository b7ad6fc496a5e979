"""End to end: the synchronous baseline learns (held-out reward rises)."""

from __future__ import annotations

import json

from jax_dora.config import base_config
from jax_dora.orchestrator.integrity import IntegrityLedger
from jax_dora.runtime import run_training


def test_sync_training_raises_heldout_reward(tmp_path):
  cfg = base_config()
  cfg.mode = "sync"
  cfg.seed = 0
  cfg.output_dir = str(tmp_path / "run")
  cfg.total_steps = 30
  cfg.progress_bar = False
  cfg.eval.every_steps = 0
  cfg.eval.num_prompts = 64
  summary = run_training(cfg)
  assert summary["steps"] == 30
  assert summary["integrity_violations"] == []
  gain = summary["final_eval_reward"] - summary["initial_eval_reward"]
  assert gain > 0.04, summary
  # Metrics and the trained-sample log are on disk and consistent.
  recs = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in recs] == list(range(1, 31))
  assert all(r["staleness_behaviour"]["max"] == 0 for r in recs)  # sync is on-policy
  ledger = IntegrityLedger.from_log(
      tmp_path / "run" / "trained_samples.jsonl", group_size=8, max_staleness=0)
  assert ledger.check() == []
  assert len(ledger.trained_records()) == 30 * 64
