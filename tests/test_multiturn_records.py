"""Multi-turn trajectories in the learner's batch and in the audit.

A tool observation sits in the completion as context: the learner's row
carries its tokens (the policy reads them) with loss mask 0, behaviour
log-prob 0 and staleness 0; the audit requires the version spans and the
context spans to tile the completion exactly.
"""

from __future__ import annotations

import numpy as np

from jax_dora.learner.batching import make_batch
from jax_dora.orchestrator.integrity import IntegrityLedger
from jax_dora.types import Prompt, TokenSpan, Trajectory


def _two_turns(context=((3, 5),), spans=((0, 3, 4), (5, 7, 4))) -> Trajectory:
  """Sampled [0,3) and [5,7) by version 4; tokens [3,5) are a tool's observation."""
  return Trajectory(
      sample_id=1, member=0, prompt=Prompt(1, "mul", "q", "a"),
      prompt_tokens=np.array([1, 20, 21], np.int32),
      completion_tokens=np.array([30, 31, 32, 40, 41, 33, 2], np.int32),
      behaviour_logprobs=np.array([-1.0, -1.1, -1.2, 0.0, 0.0, -1.3, -1.4], np.float32),
      spans=[TokenSpan(*s) for s in spans], finish_reason="eos", reward=1.0,
      start_version=4, finish_version=4, context_spans=list(context),
      tool_calls=[{"turn": 0, "tool": "calculator", "call": "2*3", "observation": "6",
                   "status": "ok", "start": 3, "end": 5, "ids": [40, 41]}])


def test_observations_are_context_in_the_learner_row():
  t = _two_turns()
  assert t.num_sampled_tokens == 5
  b = make_batch([t], np.array([0.5]), seq_len=12, learner_version=6)
  # Row: prompt (3) + completion (7) + padding; target j predicts token j + 1.
  np.testing.assert_array_equal(b["inputs"][0, :10], [1, 20, 21, 30, 31, 32, 40, 41, 33, 2][:10])
  np.testing.assert_array_equal(b["targets"][0, :9], [20, 21, 30, 31, 32, 40, 41, 33, 2])
  # Completion token j is predicted at position 2 + j: sampled at j = 0,1,2,5,6.
  np.testing.assert_array_equal(b["mask"][0], [0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 0])
  np.testing.assert_allclose(b["behaviour_logprobs"][0],
                             [0, 0, -1.0, -1.1, -1.2, 0, 0, -1.3, -1.4, 0, 0])
  np.testing.assert_array_equal(b["token_staleness"][0], [0, 0, 2, 2, 2, 0, 0, 2, 2, 0, 0])


def test_the_audit_requires_spans_and_context_to_tile_the_completion(tmp_path):
  ok, bad = _two_turns(), _two_turns(context=((3, 6),))  # overlaps the second turn's span
  dropped = _two_turns()
  dropped.behaviour_logprobs = dropped.behaviour_logprobs.copy()
  dropped.behaviour_logprobs[5] = np.nan  # a sampled token lost its behaviour log-prob
  for traj, violations in ((ok, 0), (bad, 2), (dropped, 1)):
    ledger = IntegrityLedger(tmp_path / f"{violations}.jsonl", group_size=1, max_staleness=2)
    ledger.issued(1, 0, 4)
    ledger.finished(traj)
    ledger.trained([traj], learner_version=5, step=1)
    ledger.close()
    found = ledger.check()
    assert len(found) == violations, found
    if traj is bad:
      assert "do not tile its 7 tokens" in found[0] and "is not one of its context spans" in found[1]
    if traj is dropped:
      assert "1 sampled token(s) without a behaviour log-prob" in found[0]
    again = IntegrityLedger.from_log(tmp_path / f"{violations}.jsonl", group_size=1,
                                     max_staleness=2)
    assert len(again.check()) == violations
    trained = again.trained_records()[0]
    assert trained["context"] == ([[3, 6]] if traj is bad else [[3, 5]])
    assert trained["tool_calls"][0]["observation"] == "6"
