"""Multi-turn support on a rollout server: stop strings end a turn, holds keep its version.

Real engine, real driver, real Orbax snapshots (the tiny random model): a
turn that samples the tool-call end marker ends with ``finish_reason="stop"``
right after it, and a version held between two turns (while a tool runs) is
neither retired nor replaced by a newer one until the hold is taken over or
released.
"""

from __future__ import annotations

import time

import jax
import numpy as np
import pytest

from jax_dora.model import CharTokenizer, ModelConfig, init_params
from jax_dora.rollout import api
from jax_dora.rollout.driver import RolloutDriver
from jax_dora.rollout.engine import DoraEngine
from jax_dora.snapshots import SnapshotPublisher

from test_multi_version import Collector

TOK = CharTokenizer()
CFG = ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=2, n_heads=2, d_ff=64,
                  max_seq_len=64)


def _prompt(i: int) -> np.ndarray:
  return TOK.encode(f"{i}*{i}", is_bos=True)[0]


@pytest.fixture(name="served")
def _served(tmp_path):
  engine = DoraEngine(CFG, TOK, num_slots=4, max_prefill_length=16, temperature=1.0, seed=3)
  publisher = SnapshotPublisher(tmp_path / "snaps", max_to_keep=None)
  driver = RolloutDriver(engine, str(tmp_path / "snaps"), max_versions=2, name="mt")
  yield publisher, driver
  driver.stop()
  publisher.close()


def test_a_turn_ends_right_after_its_stop_string(served):
  publisher, driver = served
  publisher.publish(0, init_params(CFG, jax.random.PRNGKey(0)))
  driver.load_version(0)
  col = Collector(driver)
  # A random policy samples "=" about once in 40 tokens: most of 24 requests of
  # 40 tokens meet it, a few do not.
  ids = [f"r{i}" for i in range(24)]
  for i, rid in enumerate(ids):
    col.submit(api.RolloutRequest(rid, _prompt(i), max_new_tokens=40, stop_strings=("=",)))
  col.wait(lambda: all(r in col.terminal for r in ids))
  reasons = {}
  for rid in ids:
    res = col.terminal[rid]
    text = TOK.decode(res.completion_tokens)
    reasons[res.finish_reason] = reasons.get(res.finish_reason, 0) + 1
    if res.finish_reason == "stop":
      assert text.endswith("=") and "=" not in text[:-1], text
    else:
      assert "=" not in text, (res.finish_reason, text)
  assert reasons.get("stop", 0) >= 3 and sum(reasons.values()) == len(ids), reasons


def test_a_held_version_stays_live_until_taken_over_or_released(served):
  publisher, driver = served
  params = {v: init_params(CFG, jax.random.PRNGKey(10 + v)) for v in range(4)}
  publisher.publish(0, params[0])
  driver.load_version(0)
  col = Collector(driver)
  col.submit(api.RolloutRequest("turn1", _prompt(1), max_new_tokens=6, hold="traj-1"))
  col.wait(lambda: "turn1" in col.terminal)
  assert col.terminal["turn1"].spans[-1].version == 0
  assert driver.status().held_versions == (0,)
  # Two newer versions arrive while "the tool runs": the held version 0 is
  # not retired; with max_versions=2 the newest (2) waits for room.
  for v in (1, 2):
    publisher.publish(v, params[v])
    driver.load_version(v)
  st = driver.status()
  assert 0 in st.versions_loaded and st.held_versions == (0,)
  assert driver.store.pending == 2
  # The next turn names the hold and no version: it runs on the held version
  # and takes the hold over (held again when it ends, for a third turn).
  first = col.terminal["turn1"]
  col.submit(api.RolloutRequest(
      "turn2", _prompt(1), max_new_tokens=12, hold="traj-1",
      resume_tokens=first.completion_tokens, resume_logprobs=first.logprobs,
      resume_spans=first.spans))
  col.wait(lambda: "turn2" in col.terminal)
  second = col.terminal["turn2"]
  assert {sp.version for sp in second.spans} == {0}
  assert driver.status().held_versions == (0,)
  # New work meanwhile went to the newest held version (1), never to 0.
  col.submit(api.RolloutRequest("other", _prompt(5), max_new_tokens=4))
  col.wait(lambda: "other" in col.terminal)
  assert col.terminal["other"].spans[0].version == 1
  # Releasing the hold frees version 0, so the pending version 2 loads.
  driver.abort(["traj-1"])
  col.submit(api.RolloutRequest("after", _prompt(6), max_new_tokens=4))
  col.wait(lambda: "after" in col.terminal)
  assert col.terminal["after"].spans[0].version == 2
  st = driver.status()
  assert st.held_versions == () and 0 not in st.versions_loaded
  assert driver.store.peak_loaded <= 2


def test_an_abandoned_hold_times_out(served):
  publisher, driver = served
  driver.holds.timeout_s = 0.2
  publisher.publish(0, init_params(CFG, jax.random.PRNGKey(0)))
  driver.load_version(0)
  col = Collector(driver)
  col.submit(api.RolloutRequest("t", _prompt(2), max_new_tokens=4, hold="gone"))
  col.wait(lambda: "t" in col.terminal)
  assert driver.status().held_versions == (0,)
  deadline = time.time() + 10  # the idle loop checks holds about once a second
  while driver.status().held_versions and time.time() < deadline:
    time.sleep(0.1)
  assert driver.status().held_versions == ()
