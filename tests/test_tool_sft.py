"""Tool-integrated SFT data: word problems whose last step needs the ``python`` tool, and SFT
rows whose tool observations are tokenised alone and kept out of the loss.

Oracles: the real sandboxed ``python`` tool re-runs each trace's program and must print the
number the trace's output block holds; products and masks are hand-computed.
"""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest

from jax_dora.base_model import SHIPPED_MODEL
from jax_dora.data import tool_word_problems as twp
from jax_dora.data import word_problems as wp
from jax_dora.data.sft import SftRow, encode_target, pack_batch
from jax_dora.learner.train_state import batch_shapes
from jax_dora.orchestrator.multiturn import FORMATS
from jax_dora.tools import PythonTool, ToolCall

TRACE = ("12 + 5 = 17\n```python\nprint(17 * 2189)\n```\n```output\n37213\n```\n"
         "17 * 2189 = 37213\n#### 37213")


def test_trace_is_the_small_steps_the_program_its_output_and_the_copied_answer():
  # 17 * 2189 = 37213 (by hand: 17 * 2000 + 17 * 189 = 34000 + 3213).
  assert twp.trace(["12 + 5 = 17"], 17, 2189) == TRACE


def test_tool_problems_are_deterministic_heldout_disjoint_and_need_a_big_multiply():
  train = list(twp.generate(60, 11, heldout=False))
  test = list(twp.generate(30, 12, heldout=True))
  assert [p.question for p in twp.generate(60, 11, heldout=False)] == [p.question for p in train]
  assert not {p.question for p in train} & {p.question for p in test}
  assert all(wp.is_heldout_question(p.question) for p in test)
  assert sorted({p.difficulty for p in train}) == [1, 2, 3]
  for p in train + test:
    lines = p.answer.splitlines()
    assert lines[-1] == f"#### {p.result}"
    small, factor = (int(x) for x in lines[-2].split(" = ")[0].split(" * "))
    assert twp.MIN_FACTOR <= factor <= twp.MAX_FACTOR and small * factor == p.result
    assert "weigh" in p.question and p.question.endswith("?")


def test_the_real_python_tool_prints_what_each_trace_says_it_printed():
  fmt = FORMATS.get("python")
  problems = list(itertools.islice(twp.generate(6, 10, heldout=False), 6))

  async def run_all():
    tool = PythonTool()
    try:
      out = []
      for p in problems:
        turn = p.answer[:p.answer.index("```\n", p.answer.index("```python")) + 4]
        code = fmt.parse(turn)
        out.append((p, await tool.run(ToolCall("python", code))))
      return out
    finally:
      tool.close()

  for p, result in asyncio.run(run_all()):
    assert result.status == "ok", result.observation
    # What a rollout appends is what the SFT trace holds.
    (start, end), = fmt.observation_spans(p.answer)
    assert fmt.wrap(result.observation) == p.answer[start:end]


def test_observation_spans_of_the_formats():
  py = FORMATS.get("python")
  (start, end), = py.observation_spans(TRACE)
  assert TRACE[start:end] == "```output\n37213\n```\n"
  assert py.wrap("37213\n") == py.wrap("37213") == "```output\n37213\n```\n"
  calc = FORMATS.get("calculator")
  assert [("4821*937=[4517277] ok"[a:b]) for a, b in calc.observation_spans(
      "4821*937=[4517277] ok")] == ["[4517277]"]


def test_pack_batch_masks_tool_observations_by_hand():
  shapes = batch_shapes(1, 10)
  template = {k: np.zeros(s, d) for k, (s, d) in shapes.items()}
  # Tokens 5..12: prompt 5, 6; target 7, 8, 9, [10, 11] (an observation: tokens 5-6), 12.
  row = SftRow(np.arange(5, 13, dtype=np.int32), 2, ((5, 7),))
  batch = pack_batch([row], template, pad_id=0)
  # Position t predicts token t + 1: positions 1-3 predict 7, 8, 9; positions 4 and 5
  # predict 10 and 11 (the tool's); position 6 predicts 12 from the observation (the model
  # reads it, then writes again); position 7 is the last token, predicting nothing.
  np.testing.assert_array_equal(batch["mask"][0], [0, 1, 1, 1, 0, 0, 1, 0, 0])


def test_tool_trace_rows_keep_exactly_the_output_block_out_of_the_loss():
  from jax_dora.model.hf_tokenizer import HFTokenizer

  tok = HFTokenizer(SHIPPED_MODEL)
  fmt = FORMATS.get("python")
  ids, spans = encode_target(tok, TRACE, fmt.observation_spans, offset=3)
  (start, end), = spans
  assert tok.decode((ids[start - 3:end - 3]).tolist()) == "```output\n37213\n```\n"
  # The observation's ids are those a rollout appends (the wrapped text encoded alone).
  assert ids[start - 3:end - 3].tolist() == list(tok.encode_ids("```output\n37213\n```\n"))
  kept = np.concatenate([ids[:start - 3], ids[end - 3:]]).tolist()
  assert tok.decode(kept) == TRACE.replace("```output\n37213\n```\n", "")
  # Without a format the target is one piece (and no span).
  whole, none = encode_target(tok, TRACE, None)
  assert none == () and tok.decode(whole.tolist()) == TRACE


@pytest.mark.parametrize("bad", ["```output\nunclosed", ""])
def test_a_target_without_a_complete_observation_is_one_piece(bad):
  assert FORMATS.get("python").observation_spans(bad) == []


def test_tool_use_shares_read_off_completion_text_by_hand():
  import pathlib
  import sys

  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
  from tool_use import tool_use  # pylint: disable=import-outside-toplevel

  completions = [
      TRACE,                                                            # called, copied
      TRACE.replace("#### 37213", "#### 2189"),                        # called, not copied
      "```python\nprint(2)\n```\n",                                     # called, no output block
      "12 + 5 = 17\n#### 17",                                           # no call
  ]
  assert tool_use(completions) == {"called": 0.75, "copied": 0.5}
  assert tool_use([]) == {"called": None, "copied": None}
