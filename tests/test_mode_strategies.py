"""The mode strategies, each driven through the real orchestrator on fakes, in milliseconds.

The real :class:`Orchestrator`, :class:`Dispatcher` and :class:`IntegrityLedger`
run every mode against the fakes of ``tests/fakes.py`` (a multi-version fake
rollout server with long-tailed lengths, a step-counting learner, a publisher
that only records versions). What each mode promises is checked from the
trained-sample log against the mode's definition written out here by hand
(``sync``: staleness 0; ``one_step_off``: exactly 1 after the first step;
``dora``: never interrupted, one version per trajectory; ...), beside the
end-to-end tests on the real learner and engines (``tests/test_orchestrator.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import pathlib

import pytest

from jax_dora.config import MODES, base_config
from jax_dora.model.tokenizer import CharTokenizer
from jax_dora.orchestrator.dispatch import Dispatcher
from jax_dora.orchestrator.integrity import IntegrityLedger
from jax_dora.orchestrator.modes import mode_class
from jax_dora.orchestrator.runner import Orchestrator, PromptSupply, RunHooks

from fakes import (
  CountingPrompts,
  FakeLearner,
  FakePublisher,
  FakeRolloutServer,
  FakeScorer,
  ListMetrics,
  SnapshotBoard,
)

GROUP, GROUPS_PER_STEP = 4, 2


@dataclasses.dataclass
class Outcome:
  summary: dict
  trained: list[dict]  # the trained-sample log's records
  records: list[dict]  # per-step metrics
  servers: list[FakeRolloutServer]
  aborts_before_end: int  # server-side aborts of running requests before the last step
  published: list[int]
  learner: FakeLearner | None = None  # holds every batch it trained


def run_mode(tmp_path: pathlib.Path, mode: str, *, steps: int = 6, max_staleness: int = 2,
             step_s: float = 0.0, pace_target: int = 4, script=None, tool_executor=None,
             **overrides) -> Outcome:
  """Runs ``mode`` on the fakes; ``script``/``tool_executor``: multi-turn (tests of
  issue 25); ``overrides``: ``{"tools.name": "calculator", ...}``."""
  cfg = base_config()
  cfg.mode = mode
  cfg.total_steps = steps
  cfg.progress_bar = False
  cfg.log_every = 0
  cfg.eval.num_prompts = 0
  cfg.eval.at_start = False
  cfg.eval.every_steps = 0
  cfg.metrics.text_every_steps = 0
  cfg.learner.group_size = GROUP
  cfg.learner.groups_per_step = GROUPS_PER_STEP
  cfg.learner.seq_len_buckets = ""
  cfg.orchestrator.max_staleness = max_staleness
  cfg.rollout.max_new_tokens = 24
  cfg.pace.target_pool_groups = pace_target
  for key, value in overrides.items():
    block, name = key.split("__") if "__" in key else key.split(".")
    cfg[block][name] = value
  board = SnapshotBoard()
  publisher = FakePublisher(board)
  learner = FakeLearner(step_s=step_s)
  publisher.publish(0, learner.params, {})  # what run_training publishes before the loop
  servers = [FakeRolloutServer(f"fake{i}", board, slots=4, seed=1, script=script)
             for i in range(2)]
  log_path = tmp_path / f"{mode}.jsonl"
  hops = bool(cfg.tools.name) and cfg.orchestrator.turn_version == "newest"  # RunConfig.turn_hops
  ledger = IntegrityLedger(log_path, group_size=GROUP, max_staleness=max_staleness,
                           allow_multi_version=mode_class(mode).resumes_rollouts,
                           allow_turn_hops=hops, incarnation="fake")
  dispatcher = Dispatcher(servers, on_reissue=ledger.reissued, seed=0, incarnation="fake")
  metrics = ListMetrics()
  aborts: list[int] = []

  def after_step(rec, orch) -> None:
    if rec["step"] == steps - 1:
      aborts.append(sum(s.aborts for s in servers))

  orch = Orchestrator(cfg, learner=learner, publisher=publisher, dispatcher=dispatcher,
                      prompts=PromptSupply(CountingPrompts()), tokenizer=CharTokenizer(),
                      scorer=FakeScorer(), ledger=ledger,
                      hooks=RunHooks(metrics, after_step=after_step), incarnation="fake",
                      tool_executor=tool_executor)

  async def main():
    try:
      return await asyncio.wait_for(orch.run(), timeout=30)
    finally:
      await dispatcher.close()

  summary = asyncio.run(main())
  ledger.close()
  trained = IntegrityLedger.from_log(log_path, group_size=GROUP, max_staleness=max_staleness,
                                     allow_multi_version=mode_class(mode).resumes_rollouts,
                                     allow_turn_hops=hops).trained_records()
  return Outcome(summary, trained, metrics.records, servers, aborts[0] if aborts else 0,
                 board.published, learner)


def versions(record: dict) -> set[int]:
  return {span[2] for span in record["spans"]}


def staleness(record: dict) -> int:
  return record["learner_version"] - min(versions(record))


def check_common(out: Outcome, steps: int = 6, max_staleness: int = 2) -> None:
  """What every mode keeps: the three DORA constraints, read from the log."""
  assert out.summary["steps"] == steps
  assert out.summary["integrity_violations"] == []
  keys = [(r["sample_id"], r["member"]) for r in out.trained]
  assert len(keys) == len(set(keys)) == steps * GROUP * GROUPS_PER_STEP
  assert all(0 <= staleness(r) <= max_staleness for r in out.trained)
  assert [rec["step"] for rec in out.records] == list(range(1, steps + 1))


# What each mode declares, written out from the modes' definitions (README,
# docs/DESIGN.md), not read back from the classes under test.
DECLARED = {
    #                  pace   background interrupts resumes streams
    "sync":            (False, False,    False,     False,  False),
    "one_step_off":    (False, False,    False,     False,  False),
    "partial_rollout": (False, False,    False,     True,   True),
    "async_unfiltered": (False, True,    True,      True,   True),
    "dora":            (False, True,     False,     False,  True),
    "dora_pace":       (True,  True,     False,     False,  True),
}


@pytest.mark.parametrize("mode", sorted(DECLARED))
def test_each_mode_declares_what_it_does(mode):
  m = mode_class(mode)
  assert m.name == mode
  assert (m.uses_pace, m.publishes_in_background, m.interrupts_on_publish, m.resumes_rollouts,
          m.streams) == DECLARED[mode]


def test_config_modes_are_the_strategies():
  assert sorted(MODES) == sorted(DECLARED)
  with pytest.raises(KeyError, match=r"unknown mode 'dora2'.*'dora_pace'"):
    mode_class("dora2")


def test_sync_trains_only_on_policy(tmp_path):
  out = run_mode(tmp_path, "sync")
  check_common(out)
  assert all(staleness(r) == 0 and len(versions(r)) == 1 for r in out.trained)
  assert out.aborts_before_end == 0
  assert out.published == list(range(0, 7))  # every version, in order, before the next batch


def test_one_step_off_is_exactly_one_version_behind(tmp_path):
  out = run_mode(tmp_path, "one_step_off")
  check_common(out)
  by_step = {}
  for r in out.trained:
    by_step.setdefault(r["learner_version"], set()).add(staleness(r))
    assert len(versions(r)) == 1
  assert by_step[0] == {0}  # the first batch: generated by version 0, trained at 0
  assert all(by_step[v] == {1} for v in range(1, 6))


def test_dora_streams_without_interrupting(tmp_path):
  # A learner step long enough that the long-tailed rollouts cross versions.
  out = run_mode(tmp_path, "dora", step_s=0.01)
  check_common(out)
  assert all(len(versions(r)) == 1 for r in out.trained)  # intra-trajectory consistency
  assert max(staleness(r) for r in out.trained) >= 1  # it trained off-policy data
  assert out.aborts_before_end == 0  # no rollout was interrupted for a publish
  # Several versions generated at the same time on one server: multi-version rollout.
  assert max(s.max_live_versions for s in out.servers) >= 2
  assert "pace" not in out.records[-1]


def test_dora_pace_rejects_from_an_over_full_pool(tmp_path):
  out = run_mode(tmp_path, "dora_pace", step_s=0.02, pace_target=1)
  check_common(out)
  assert all(len(versions(r)) == 1 for r in out.trained)
  rejected = {k: v for k, v in out.summary["rejected_groups"].items() if k.startswith("pace")}
  assert sum(rejected.values()) > 0, out.summary["rejected_groups"]
  assert out.records[-1]["pace_rejected_total"] == sum(rejected.values())
  assert "pace" in out.records[-1]


def test_async_unfiltered_interrupts_and_resumes_on_the_new_version(tmp_path):
  out = run_mode(tmp_path, "async_unfiltered", step_s=0.01)
  check_common(out)
  assert out.aborts_before_end > 0
  multi = [r for r in out.trained if len(versions(r)) > 1]
  assert multi, "a publish should have interrupted a rollout that then resumed"
  for r in multi:  # spans are contiguous, versions never go back
    spans = r["spans"]
    assert all(a[1] == b[0] and a[2] <= b[2] for a, b in zip(spans, spans[1:]))


def test_partial_rollout_aborts_the_tail_and_resumes_it(tmp_path):
  out = run_mode(tmp_path, "partial_rollout")
  check_common(out)
  assert out.aborts_before_end > 0
  assert any(len(versions(r)) > 1 for r in out.trained)
  # It publishes synchronously: every version, in order.
  assert out.published == list(range(0, 7))
