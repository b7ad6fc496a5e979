"""Dataset files through Grain: formats, bad rows, Parquet, splits, resume, overlong prompts."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jax_dora.config import base_config
from jax_dora.data import (
    DatasetError,
    PromptStream,
    load_file_splits,
    make_eval_prompts,
    read_records,
)
from jax_dora.data.formats import get_format

GSM8K_ROWS = [
    {"question": f"Tom has {i} apples and buys {i + 3} more. How many now?",
     "answer": f"He has {i} + {i + 3} = {2 * i + 3} apples.\n#### {2 * i + 3:,}"}
    for i in range(40)
]


def _write_jsonl(path, rows, extra_lines=()):
  with open(path, "w") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")
    for line in extra_lines:
      f.write(line + "\n")
  return str(path)


def _cfg(train, eval_files="", **data):
  c = base_config()
  c.data.train_files = train
  c.data.eval_files = eval_files
  c.data.update(data)
  return c


def test_gsm8k_jsonl_skips_bad_rows_with_a_count(tmp_path, caplog):
  bad = ['{"question": "no answer here"}', "{not json", '{"question": "q", "answer": "no marker"}', ""]
  path = _write_jsonl(tmp_path / "train.jsonl", GSM8K_ROWS, bad)
  table = read_records([path], get_format("gsm8k"))
  assert len(table) == 40
  assert table[3]["answer"] == "9" and table[3]["row"] == 4
  assert table[39]["answer"] == "81"
  # 1,000-style thousands separators are dropped: "#### 1,001" -> "1001".
  big = read_records([_write_jsonl(tmp_path / "big.jsonl", [
      {"question": "q", "answer": "#### 1,001"}])], get_format("gsm8k"))
  assert big[0]["answer"] == "1001"
  assert sum(table.skipped.values()) == 3
  assert "skipped 3 bad row(s) of 43" in caplog.text
  assert f"{path}:41: no answer field 'answer'" in caplog.text


def test_on_bad_row_error_names_file_and_line(tmp_path):
  path = _write_jsonl(tmp_path / "train.jsonl", GSM8K_ROWS[:5], ['{"question": "x"}'])
  with pytest.raises(DatasetError, match=rf"{path}:6: no answer field 'answer'"):
    read_records([path], get_format("gsm8k"), on_bad_row="error")
  with pytest.raises(DatasetError, match="no usable row"):
    read_records([path], get_format("gsm8k", prompt_field="problem"))
  with pytest.raises(DatasetError, match="does not exist"):
    read_records([str(tmp_path / "nope.jsonl")], get_format("gsm8k"))


def test_parquet_math_format_and_missing_column(tmp_path):
  rows = {"problem": ["Compute 1/2 + 0.", "What is 2+2?"],
          "solution": ["So it is $\\boxed{\\frac{1}{2}}$.", "We get \\boxed{4}, done."]}
  path = str(tmp_path / "math.parquet")
  pq.write_table(pa.table(rows), path)
  table = read_records([path], get_format("math"))
  assert [table[i]["answer"] for i in range(2)] == ["\\frac{1}{2}", "4"]
  with pytest.raises(DatasetError, match=r"no column \['question', 'answer'\]"):
    read_records([path], get_format("gsm8k"))


def test_stream_is_deterministic_resumable_and_eval_split_disjoint(tmp_path):
  path = _write_jsonl(tmp_path / "train.jsonl", GSM8K_ROWS)
  cfg = _cfg(path, heldout_fraction=0.2)
  splits = load_file_splits(cfg)
  assert len(splits.train) + len(splits.eval) == 40 and len(splits.eval) > 0
  s = PromptStream(cfg)
  first = [s.next_prompt() for _ in range(7)]
  state = s.get_state()
  rest = [s.next_prompt() for _ in range(50)]  # past one epoch: repeats with new ids
  resumed = PromptStream(cfg)
  resumed.set_state(json.loads(json.dumps(state)))
  assert [resumed.next_prompt() for _ in range(50)] == rest
  assert [p.sample_id for p in first + rest] == list(range(57))
  assert first[0].task == "gsm8k" and first[0].meta["file"] == path
  evals = make_eval_prompts(cfg, 100)
  assert len(evals) == len(splits.eval) and [p.sample_id for p in evals][:2] == [-1, -2]
  assert not {p.text for p in evals} & {p.text for p in first + rest}


def test_eval_files_and_overlong_prompts_dropped_with_tokenizer(tmp_path, hf_dirs, caplog):
  from jax_dora.model.hf_tokenizer import HFTokenizer

  long_q = {"question": "how many " * 200 + "?", "answer": "#### 1"}
  train = _write_jsonl(tmp_path / "train.jsonl", GSM8K_ROWS[:30] + [long_q])
  evals = _write_jsonl(tmp_path / "test.jsonl", GSM8K_ROWS[30:])
  cfg = _cfg(train, evals, prompt_template="chat")
  cfg.model.hf_path = hf_dirs["qwen2"]
  cfg.rollout.max_prefill_length = 128
  tok = HFTokenizer(hf_dirs["qwen2"], "chat")
  splits = load_file_splits(cfg, tok)
  assert (len(splits.train), len(splits.eval), splits.overlong) == (30, 10, 1)
  assert "dropped 1 prompt(s) longer than 128 tokens" in caplog.text
  assert all(len(tok.encode_prompt(t)) <= cfg.rollout.max_prefill_length for t in splits.train.texts)
