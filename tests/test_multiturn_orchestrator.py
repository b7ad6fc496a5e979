"""Multi-turn trajectories through the real orchestrator, on fakes, in milliseconds.

The fake rollout servers follow a script: the first turn writes a product and
stops at the calculator's marker (``"12*34="``); after the observation
(``"[408]"``) the second turn writes an answer. The real orchestrator,
dispatcher, ledger and calculator tool run the turns. Checked against the
definition of each mode: with ``orchestrator.turn_version=held`` every token
of a ``dora`` trajectory is sampled by one version, also when versions are
published while the tool runs (the version is held on its server and the
next turn goes there); with ``newest`` (the default) each turn is one version
and a turn may start on a newer one; in ``async_unfiltered`` turns may move
to newer versions anywhere. The learner's row is
byte for byte the sampled ids plus the observation ids.
"""

from __future__ import annotations

import numpy as np
import pytest

from jax_dora.model.tokenizer import CharTokenizer
from jax_dora.orchestrator import staleness as staleness_lib
from jax_dora.tools import ToolExecutor
from jax_dora.types import Prompt

from test_mode_strategies import GROUP, GROUPS_PER_STEP, run_mode, staleness, versions

TOK = CharTokenizer()


def calculator_script(sample_id: int, member: int, so_far: str) -> str:
  a, b = 10 + sample_id % 50, 2 + member
  if "[" not in so_far:
    return f"{a}*{b}="  # first turn: the call
  return f"{a * b}"  # after the observation: the answer (EOS follows)


def no_call_script(sample_id: int, member: int, so_far: str) -> str:
  del so_far
  return f"{sample_id + member}"  # one turn, no tool call


def _run(tmp_path, mode, **kw):
  with ToolExecutor(["calculator"], max_concurrency=4, extra_latency_s=0.01) as tools:
    out = run_mode(tmp_path, mode, step_s=0.01, script=calculator_script, tool_executor=tools,
                   **{"tools.name": "calculator"}, **kw)
    return out, tools.metrics()


@pytest.mark.parametrize("mode", ["dora", "dora_pace", "sync"])
def test_each_turn_stays_on_the_trajectorys_version(tmp_path, mode):
  out, metrics = _run(tmp_path, mode, **{"orchestrator.turn_version": "held"})
  assert out.summary["integrity_violations"] == []
  assert len(out.trained) == 6 * GROUP * GROUPS_PER_STEP
  for r in out.trained:
    assert len(versions(r)) == 1, r["spans"]  # both turns: one version
    assert staleness(r) <= 2
    (call,) = r["tool_calls"]
    a, b = 10 + r["sample_id"] % 50, 2 + r["member"]
    assert call["call"] == f"{a}*{b}" and call["observation"] == str(a * b)
    assert call["status"] == "ok"
    # Sampled "a*b=", then the observation "[a*b]" (context), then the answer.
    first = len(f"{a}*{b}=")
    assert r["context"] == [[first, first + len(str(a * b)) + 2]]
    assert call["ids"] == TOK.encode_ids(f"[{a * b}]").tolist()
  assert metrics["tools/calls"] >= len(out.trained) and metrics["tools/errors"] == 0
  # Every hold was taken over by the next turn and released at the end.
  assert sum(s.hold_takeovers for s in out.servers) >= len(out.trained)
  assert all(not s.holds for s in out.servers)
  assert out.records[-1]["tools/calls_per_trajectory"] == 1.0


def test_a_per_turn_hop_changes_versions_only_between_turns(tmp_path):
  """``turn_version=newest``: a turn runs on the newest version when it starts and keeps it
  to its end; the hold pins nothing (no version stays loaded for it), the audit is clean."""
  with ToolExecutor(["calculator"], max_concurrency=4, extra_latency_s=0.05) as tools:
    out = run_mode(tmp_path, "dora", step_s=0.01, script=calculator_script,
                   tool_executor=tools, **{"tools.name": "calculator",
                                           "orchestrator.turn_version": "newest"})
  assert out.summary["integrity_violations"] == []
  moved = 0
  for r in out.trained:
    (ctx,) = r["context"]
    turns = [{v for s, e, v in r["spans"] if e <= ctx[0]}, {v for s, e, v in r["spans"]
                                                             if s >= ctx[1]}]
    assert all(len(t) == 1 for t in turns), r["spans"]  # one version per turn
    moved += turns[0] != turns[1]
    assert staleness(r) <= 2
  # Versions were published during tool calls (50 ms each, learner steps of 10 ms):
  # some second turns started on a newer version than their first.
  assert moved > 0
  assert all(not s.holds for s in out.servers)


def test_async_unfiltered_turns_may_move_to_newer_versions(tmp_path):
  out, _ = _run(tmp_path, "async_unfiltered")
  assert out.summary["integrity_violations"] == []
  assert all(not s.holds and s.hold_takeovers == 0 for s in out.servers)  # no holds there
  assert all(r["tool_calls"][0]["observation"] for r in out.trained)


def test_the_learner_row_is_the_sampled_ids_plus_the_observation_ids(tmp_path):
  """Token in, token out: each trained row is the prompt, the sampled ids of both turns
  and the observation's ids between them, exactly; only the sampled ids are trained."""
  out, _ = _run(tmp_path, "dora", steps=2)
  expected = {}
  for r in out.trained:
    a, b = 10 + r["sample_id"] % 50, 2 + r["member"]
    call, obs, answer = (TOK.encode_ids(x) for x in (f"{a}*{b}=", f"[{a * b}]", str(a * b)))
    row = np.concatenate([TOK.encode_prompt(f"q{r['sample_id']}"), call, obs, answer, [2]])
    trained = np.concatenate([np.ones(len(call)), np.zeros(len(obs)), np.ones(len(answer) + 1)])
    expected[tuple(row.tolist())] = trained
  seen = 0
  for batch in out.learner.batches:
    for i in range(len(batch["inputs"])):
      tokens = np.concatenate([batch["inputs"][i][:1], batch["targets"][i]])
      n = int(np.max(np.flatnonzero(tokens))) + 1  # right padding is 0 (PAD)
      key = tuple(tokens[:n].tolist())
      assert key in expected, TOK.decode(tokens[:n])
      p = n - len(expected[key])  # prompt length: completion token j is target p - 1 + j
      np.testing.assert_array_equal(batch["mask"][i][p - 1:n - 1], expected[key])
      seen += 1
  assert seen == len(out.trained) == 2 * GROUP * GROUPS_PER_STEP


def test_tool_wait_counts_for_the_tokens_sampled_before_the_call():
  from _traj import make_traj  # pylint: disable=g-import-not-at-top

  t = make_traj(1, 0, spans=[(0, 4, 3), (6, 10, 3)])
  t.context_spans = [(4, 6)]
  t.completion_tokens = np.full((10,), 7, np.int32)
  t.behaviour_logprobs = np.zeros((10,), np.float32)
  t.tool_calls = [{"start": 4, "version_start": 3, "version_end": 5}]
  # 4 of 8 sampled tokens came before a call during which 2 versions were published.
  assert staleness_lib.tool_wait_staleness(t) == pytest.approx(2 * 4 / 8)


def test_the_audit_reruns_tool_calls_and_catches_an_altered_observation(tmp_path):
  import asyncio  # pylint: disable=g-import-not-at-top

  from jax_dora.orchestrator.multiturn import ToolLoop, recheck_tool_calls  # pylint: disable=g-import-not-at-top

  out, _ = _run(tmp_path, "dora", steps=2)
  assert out.summary["tool_audit"]["rechecked"] == 16
  with ToolExecutor(["calculator"]) as tools:
    loop = ToolLoop("calculator", tools, TOK, max_calls=4, max_observation_tokens=64)
    clean, counts = asyncio.run(recheck_tool_calls(out.trained, loop, sample=1000))
    assert clean == [] and counts["rechecked"] == len(out.trained)
    altered = [dict(r) for r in out.trained]
    altered[3] = dict(altered[3], tool_calls=[dict(altered[3]["tool_calls"][0], observation="7")])
    found, _ = asyncio.run(recheck_tool_calls(altered, loop, sample=1000))
    assert len(found) == 1 and "recorded observation '7'" in found[0]


def test_no_hold_outlives_a_trajectory_that_never_called_the_tool(tmp_path):
  with ToolExecutor(["calculator"]) as tools:
    out = run_mode(tmp_path, "dora", step_s=0.01, script=no_call_script, tool_executor=tools,
                   **{"tools.name": "calculator"})
  assert out.summary["integrity_violations"] == []
  assert all(not s.holds for s in out.servers)
  assert all("tool_calls" not in r for r in out.trained)


def test_a_call_over_the_limit_is_recorded_as_not_run(tmp_path):
  """Past tools.max_calls the tool does not run: the record says so (call None), and the
  end-of-run audit does not re-run it (it found such a call 'wrong' in the suite once)."""
  def two_calls(sample_id: int, member: int, so_far: str) -> str:
    del sample_id, member
    return "2*3=" if so_far.count("[") < 2 else "6"

  with ToolExecutor(["calculator"]) as tools:
    out = run_mode(tmp_path, "dora", step_s=0.01, script=two_calls, tool_executor=tools,
                   steps=2, **{"tools.name": "calculator", "tools.max_calls": 1})
  assert out.summary["integrity_violations"] == []
  for r in out.trained:
    first, second = r["tool_calls"]
    assert first["call"] == "2*3" and first["observation"] == "6"
    assert second["call"] is None and second["parsed"] == "2*3"
    assert second["observation"] == "tool call limit reached"


def test_a_turn_reaching_max_turn_tokens_ends_the_trajectory(tmp_path):
  """tools.max_turn_tokens caps each turn, not the trajectory: the call turn (6 tokens)
  fits, the answer turn is cut at 7 sampled tokens with budget left (finish 'length')."""
  def long_answer(sample_id: int, member: int, so_far: str) -> str:
    del sample_id, member
    return "12*34=" if "[" not in so_far else "1234567890"

  with ToolExecutor(["calculator"]) as tools:
    out = run_mode(tmp_path, "dora", step_s=0.01, script=long_answer, tool_executor=tools,
                   steps=2, **{"tools.name": "calculator", "tools.max_turn_tokens": 7})
  assert out.summary["integrity_violations"] == []
  for r in out.trained:
    (call,) = r["tool_calls"]
    assert call["observation"] == "408" and (call["start"], call["end"]) == (6, 11)
    # 6 call tokens + 5 observation tokens + 7 answer tokens (uncapped: 10 and EOS),
    # under the trajectory's budget of 24.
    assert r["num_tokens"] == 18 and r["sampled_tokens"] == 13


def test_a_calculator_call_writes_its_expression_out():
  from jax_dora.orchestrator.multiturn import CalculatorFormat  # pylint: disable=g-import-not-at-top
  fmt = CalculatorFormat()
  assert fmt.parse("so 12*34=") == "12*34"
  assert fmt.parse("x(1+2)*3=") == "(1+2)*3"
  assert fmt.parse("abc=") is None  # a bare '=' on a prompt without an expression: no call
  assert fmt.parse("*=") is None and fmt.parse("no marker") is None
  own = Prompt(0, "mul", "mul 12*34:", "408", meta={"expression": "12*34"})
  assert fmt.parse("abc=", own) == "12*34"  # a bare '=': the prompt's own expression
  assert fmt.parse("1*2=", own) == "1*2"  # a written expression is the call


@pytest.mark.parametrize("restart", [False, True])
def test_a_trajectory_past_the_bound_at_a_turn_boundary_starts_over(tmp_path, restart):
  """``orchestrator.restart_stale_turns``: tool calls (60 ms) outlast several learner steps
  (10 ms), so a first turn is often more than ``max_staleness`` behind the learner when its call
  ends. With the option, such a trajectory starts over instead of running its second turn (its
  group could only be evicted), every restart is in the ledger with its reason, and the run's
  integrity and bound still hold; without it, nothing restarts."""
  import json  # pylint: disable=g-import-not-at-top

  with ToolExecutor(["calculator"], max_concurrency=8, extra_latency_s=0.06) as tools:
    out = run_mode(tmp_path, "dora_pace", step_s=0.01, script=calculator_script,
                   tool_executor=tools, **{"tools.name": "calculator",
                                           "orchestrator.restart_stale_turns": restart})
  assert out.summary["integrity_violations"] == []
  assert all(staleness(r) <= 2 for r in out.trained)
  restarts = out.records[-1]["tools/stale_turn_restarts_total"]
  ledger = [json.loads(line) for line in (tmp_path / "dora_pace.jsonl").read_text().splitlines()]
  stale = [e for e in ledger if e.get("event") == "reissued"
           and "past the staleness bound at a turn boundary" in e["why"]]
  if restart:
    assert 0 < restarts <= len(stale)  # the ledger also sees restarts after the last record
  else:
    assert restarts == 0 and not stale


def test_past_the_bound_is_the_oldest_span_against_the_learner():
  """By hand: spans from versions 3 and 5; bound 2. Learner 5: 5 - 3 = 2, within; learner 6:
  6 - 3 = 3, past (the newer span does not matter)."""
  from jax_dora.orchestrator.collector import TrajectoryCollector  # pylint: disable=g-import-not-at-top
  from jax_dora.types import TokenSpan, Trajectory  # pylint: disable=g-import-not-at-top

  learner = [5]
  col = TrajectoryCollector(None, None, learner_version=lambda: learner[0], stale_after=2)
  traj = Trajectory(sample_id=1, member=0, prompt=Prompt(1, "t", "x", "y"),
                    prompt_tokens=np.asarray([1], np.int32),
                    completion_tokens=np.asarray([5, 6, 7, 8], np.int32),
                    behaviour_logprobs=np.zeros(4, np.float32),
                    spans=[TokenSpan(0, 2, 3), TokenSpan(3, 4, 5)], finish_reason="stop")
  assert not col._past_bound(traj)  # pylint: disable=protected-access
  learner[0] = 6
  assert col._past_bound(traj)  # pylint: disable=protected-access
  assert not TrajectoryCollector(None, None, learner_version=lambda: 6)._past_bound(traj)  # pylint: disable=protected-access
