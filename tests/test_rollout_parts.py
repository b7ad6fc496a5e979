"""The rollout server's host-side parts, each on its own: bucket tables, prefill planning, the
slot table's position rule and step inputs, stop conditions, admission. Numbers by hand."""

from __future__ import annotations

import numpy as np
import pytest

from jax_dora.model import CharTokenizer
from jax_dora.rollout import api
from jax_dora.rollout.admission import Admitted, admit
from jax_dora.rollout.buckets import ProgramBuckets
from jax_dora.rollout.prefill_plan import plan_prefill
from jax_dora.rollout.slot_table import Active, SlotTable
from jax_dora.rollout.stop_conditions import StopConditions
from jax_dora.rollout.version_holds import VersionHolds
from jax_dora.rollout.version_store import VersionStore
from jax_dora.types import TokenSpan

TOK = CharTokenizer()


def _buckets(**kw) -> ProgramBuckets:
  args = dict(num_slots=16, max_prefill_length=32, max_seq_len=256, prefill_batch_tokens=256)
  args.update(kw)
  return ProgramBuckets.build(**args)


def test_bucket_tables_by_hand():
  b = _buckets()
  assert b.prefill_lengths == (32, 64, 128, 256)
  assert b.decode_lengths == (128, 256)  # doubling from max(128, 256 // 32)
  assert b.pass_rows == (2, 4, 8, 16)  # slots / 8, / 4, / 2, all
  assert b.prefill_rows(32) == (1, 4, 8)  # powers of 4, capped at 256 // 32 = 8 rows
  assert b.prefill_rows(256) == (1,)
  assert [b.prefill_length(n) for n in (1, 32, 33, 200)] == [32, 32, 64, 256]
  assert [b.decode_length(p) for p in (0, 128, 129, 256)] == [128, 128, 256, 256]
  assert [b.pass_size(r) for r in (1, 3, 9, 16)] == [2, 4, 16, 16]
  with pytest.raises(ValueError, match="exceed"):
    b.prefill_length(257)
  assert _buckets(length_buckets=(16, 48)).decode_lengths == (16, 48, 256)
  assert _buckets(dense_decode=True).decode_lengths == (256,)


def test_prefill_plan_shares_a_groups_prompt_and_lays_out_the_call():
  counter = iter(range(1, 100))
  b = _buckets(num_slots=8)
  group = np.array([1, 5, 6, 7], np.int32)
  other = np.array([1, 9], np.int32)
  long = np.arange(40, dtype=np.int32) + 3  # the 64 bucket: a call of its own
  calls, work = plan_prefill([group, other, group, long, group], [3, 0, 5, 7, 1], b, pad_id=0,
                             share_prompts=True, next_count=lambda: next(counter))
  assert [c.tokens.shape for c in calls] == [(4, 32), (1, 64)]  # 2 distinct short -> 4 rows
  short = calls[0]
  np.testing.assert_array_equal(short.tokens[0, :5], [1, 5, 6, 7, 0])
  np.testing.assert_array_equal(short.lengths, [4, 2, 1, 1])
  # Requests 0, 2, 4 share context row 0 and go to slots 3, 5, 1; request 1 (row 1) to slot 0;
  # the other entries point past the slots (dropped).
  np.testing.assert_array_equal(short.src[:4], [0, 0, 0, 1])
  np.testing.assert_array_equal(short.dst, [3, 5, 1, 0, 8, 8, 8, 8])
  assert short.users == [(0, 0, 0), (2, 1, 0), (4, 2, 0), (1, 3, 1)]
  np.testing.assert_array_equal(short.counts[:4], [1, 2, 3, 4])  # a key per slot, not per context
  assert calls[1].users == [(3, 0, 0)] and list(calls[1].dst[:1]) == [7]
  assert (work.requests, work.requested_tokens, work.computed_tokens, work.padded_tokens,
          work.calls) == (5, 4 * 3 + 2 + 40, 4 + 2 + 40, 4 * 32 + 64, 2)
  unshared, w = plan_prefill([group, group], [0, 1], b, pad_id=0, share_prompts=False,
                             next_count=lambda: 0)
  assert unshared[0].tokens.shape == (4, 32) and w.computed_tokens == 8
  for bad, slots in (([group], [8]), ([group, group], [1, 1]), ([np.zeros(0, np.int32)], [0])):
    with pytest.raises(ValueError):
      plan_prefill(bad, slots, b, pad_id=0, share_prompts=True, next_count=lambda: 0)


def _active(slot: int, version: int, context_len: int, budget: int = 10) -> Active:
  req = api.RolloutRequest(f"r{slot}", np.ones((context_len,), np.int32), budget)
  return Active(req, lambda item: None, version, slot, context_len, budget,
                api.ResumeParts.of(req))


def test_slot_table_position_rule_and_step_inputs():
  t = SlotTable(num_slots=4, max_seq_len=12)
  first = t.occupy(_active(1, version=3, context_len=5))
  t.occupy(_active(2, version=4, context_len=9))
  params, hint = t.step_inputs(lambda v: f"params{v}")
  assert params.live == (3, 4) and dict(params.params) == {3: "params3", 4: "params4"}
  assert hint.max_position == 9 and dict(hint.version_rows) == {3: 1, 4: 1}
  owners = t.owner.copy()
  for _ in range(4):
    t.advance()
  np.testing.assert_array_equal(t.position[[1, 2]], [9, 12])  # 9 + 4 capped at the cache end
  t.vacate(2)
  t.occupy(_active(2, version=4, context_len=2))  # a new occupant of slot 2
  np.testing.assert_array_equal(t.still_owned(owners), [1])  # slot 2's result is not its own
  assert t.free_slots() == [0, 3] and first == 1
  t.append(np.array([1, 2]), np.array([7, 8]), np.array([-0.5, -1.5], np.float32))
  tokens, lps = t.sampled(1)
  assert tokens.tolist() == [7] and lps.tolist() == [-0.5]
  chunk = t.unsent(t.occupants[1])
  assert chunk.tokens.tolist() == [7] and t.unsent(t.occupants[1]) is None


def test_stop_conditions_by_hand():
  stops = StopConditions(TOK)
  eos = TOK.eos_id
  ended, full = stops.ended(np.array([eos, eos, 5]), np.array([1, 1, 4]), np.array([9, 9, 4]),
                            np.array([False, True, False]))
  assert ended.tolist() == [True, False, False] and full.tolist() == [False, False, True]
  assert stops.triggers(()) == frozenset()
  assert TOK.encode_ids("=")[0] in stops.triggers(("=",))
  ids = TOK.encode_ids("12*3=")
  assert stops.completes_stop_string(ids, ("=",))
  assert not stops.completes_stop_string(ids[:-1], ("=",))
  assert not StopConditions(TOK, stop_on_eos=False).ended(
      np.array([eos]), np.array([1]), np.array([9]), np.array([False]))[0][0]


def test_admission_pins_the_holds_version_and_answers_what_cannot_run():
  store, holds = VersionStore(3), VersionHolds(timeout_s=60)
  kw = dict(name="s", store=store, holds=holds, incarnation="inc", max_seq_len=16,
            model_cfg=None, routing_shape=None)
  assert store.begin_load(1).value == "load"
  store.finish_load(1, "p1")
  first = admit(api.RolloutRequest("a", np.ones(4, np.int32), 8, hold="h"), **kw)
  assert isinstance(first, Admitted) and first.version == 1 and first.budget == 8
  assert store.begin_load(2).value == "load"
  store.finish_load(2, "p2")
  holds.take("h", 1, store)  # the first turn ended at a tool call: its pin is the hold's now
  assert store.loaded == (1, 2)  # version 1 stays, pinned by the hold
  new = admit(api.RolloutRequest("b", np.ones(4, np.int32), 8), **kw)
  assert isinstance(new, Admitted) and new.version == 2  # new work: the newest
  turn = admit(api.RolloutRequest("c", np.ones(4, np.int32), 8, hold="h",
                                  resume_tokens=np.array([5, 6], np.int32),
                                  resume_spans=(TokenSpan(0, 2, 1),)), **kw)
  assert isinstance(turn, Admitted) and turn.version == 1 and "h" not in holds
  assert turn.context.tolist() == [1, 1, 1, 1, 5, 6] and turn.budget == 6  # 8 - 2 resumed
  other = admit(api.RolloutRequest("d", np.ones(4, np.int32), 8, incarnation="old"), **kw)
  assert isinstance(other, api.IncarnationMismatchError)
  overlong = admit(api.RolloutRequest("e", np.ones(16, np.int32), 8), **kw)
  assert isinstance(overlong, api.RolloutError) and "no room" in str(overlong)
  done = admit(api.RolloutRequest("f", np.ones(4, np.int32), 2,
                                  resume_tokens=np.array([5, 6], np.int32)), **kw)
  assert isinstance(done, api.RolloutResult) and done.finish_reason == "length"
  assert done.completion_tokens.tolist() == [5, 6]
