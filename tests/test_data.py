"""Data pipeline: exact resumption, unique ids, held-out eval split."""

from __future__ import annotations

import json

import grain
import pytest

from jax_dora.config import base_config
from jax_dora.data import (
    PromptStream,
    is_heldout,
    make_eval_prompts,
    make_prompt_dataset,
)


def _cfg(**data):
  c = base_config()
  c.data.update(data)
  return c


def test_stream_state_round_trip_resumes_exactly():
  cfg = _cfg()
  s = PromptStream(cfg)
  for _ in range(37):
    s.next_prompt()
  state = json.loads(json.dumps(s.get_state()))  # survives a JSON checkpoint
  expected = [s.next_prompt() for _ in range(25)]
  fresh = PromptStream(cfg)
  fresh.set_state(state)
  assert [fresh.next_prompt() for _ in range(25)] == expected
  assert expected[0].sample_id == 37


def test_sample_ids_unique_and_monotonic_across_epochs():
  cfg = _cfg(num_examples=40)
  prompts = [p for _, p in zip(range(100), PromptStream(cfg))]
  assert [p.sample_id for p in prompts] == list(range(100))
  # Each epoch is a reshuffled pass over the same examples.
  e0, e1 = prompts[:40], prompts[40:80]
  assert sorted(p.text for p in e0) == sorted(p.text for p in e1)
  assert [p.text for p in e0] != [p.text for p in e1]


def test_finite_epochs_stop_and_resume_across_epoch_boundary():
  cfg = _cfg(num_examples=10, num_epochs=2)
  s = PromptStream(cfg)
  for _ in range(8):
    s.next_prompt()
  state = s.get_state()
  rest = [p.sample_id for p in s]
  assert rest == list(range(8, 20))
  fresh = PromptStream(cfg)
  fresh.set_state(state)
  assert [p.sample_id for p in fresh] == rest


def test_dataset_is_random_access_and_deterministic():
  cfg = _cfg()
  ds = make_prompt_dataset(cfg)
  assert isinstance(ds, grain.MapDataset)
  assert ds[12345] == make_prompt_dataset(cfg)[12345]
  assert ds[12345].sample_id == 12345
  other = make_prompt_dataset(_cfg(seed=5))
  assert [ds[i].text for i in range(20)] != [other[i].text for i in range(20)]


def test_prompts_fit_rollout_buffers():
  cfg = base_config()
  for _, p in zip(range(2000), PromptStream(cfg)):
    assert len(p.text) + 1 <= cfg.rollout.max_prefill_length  # + BOS
    assert len(p.answer) <= cfg.rollout.max_new_tokens


def test_eval_prompts_disjoint_from_train():
  cfg = _cfg()
  n_train = 3000
  train = [p for _, p in zip(range(n_train), PromptStream(cfg))]
  evals = make_eval_prompts(cfg, 200)
  assert {p.text for p in train}.isdisjoint({p.text for p in evals})
  assert [p.sample_id for p in evals] == [-(i + 1) for i in range(200)]
  assert all(is_heldout(p, cfg.data.heldout_fraction) for p in evals)
  assert not any(is_heldout(p, cfg.data.heldout_fraction) for p in train)
  assert make_eval_prompts(cfg, 200) == evals


def test_set_state_rejects_other_data_config():
  state = PromptStream(_cfg()).get_state()
  other = PromptStream(_cfg(seed=3))
  with pytest.raises(ValueError, match="different data config"):
    other.set_state(state)


def test_accepts_data_subconfig_and_validates():
  d = base_config().data
  assert PromptStream(d).next_prompt().sample_id == 0
  with pytest.raises(ValueError, match="eval_seed"):
    make_eval_prompts(_cfg(eval_seed=0), 1)
