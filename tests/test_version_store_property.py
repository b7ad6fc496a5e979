"""VersionStore invariants: the newest version is never evicted, the cap holds.

A deterministic regression (issue 12, defect 7) plus a hypothesis state
machine that drives the store the way ``RolloutDriver`` does (serialized
loads, pending versions taken once pins release, admission only while
``admitting``) and checks the invariants after every step.
"""

from __future__ import annotations

import collections

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
  RuleBasedStateMachine,
  initialize,
  invariant,
  precondition,
  rule,
)

from jax_dora.rollout.api import VersionUnavailableError
from jax_dora.rollout.version_store import LoadDecision, VersionStore


def _load(store: VersionStore, v: int) -> None:
  assert store.begin_load(v) is LoadDecision.LOAD
  store.finish_load(v, f"p{v}")


def test_newest_unpinned_version_is_not_evicted_to_make_room():
  """Issue 12 defect 7: loading 6 used to free the unpinned newest (5), so new
  requests went back to the pinned older version 4 for the whole load."""
  store = VersionStore(2)
  _load(store, 4)
  pinned = store.acquire(4)
  _load(store, 5)
  assert store.loaded == (4, 5) and store.newest == 5
  decision = store.begin_load(6)
  assert store.newest == 5 and store.is_loaded(5)
  assert store.acquire() == 5  # new work still starts on the newest version
  assert decision is LoadDecision.PENDING and store.pending == 6
  assert store.num_loaded == 2 and store.admitting
  assert store.take_pending() is None  # 4 is still pinned, 5 is the newest
  store.release(5)
  assert store.take_pending() is None
  store.release(pinned)  # 4's last slot: freed, room for 6
  assert store.loaded == (5,)
  assert store.take_pending() == 6 and store.num_loaded == 2
  assert store.acquire() == 5  # still admitting on 5 while 6 loads
  store.finish_load(6, "p6")
  assert store.newest == 6 and store.acquire() == 6
  assert store.loaded == (5, 6) and store.peak_loaded == 2


def test_single_version_evicts_newest_only_while_admission_pauses():
  """max_versions=1: the one held version is the newest; loading the next one
  frees it (if unpinned), and nothing is served until the load finishes."""
  store = VersionStore(1)
  _load(store, 5)
  assert store.begin_load(6) is LoadDecision.LOAD
  assert store.loaded == () and store.newest is None and not store.admitting
  with pytest.raises(VersionUnavailableError):
    store.acquire()
  store.abort_load(6)
  # Never back below a version that was already the newest.
  assert store.begin_load(4) is LoadDecision.LOADED and store.loading is None
  assert store.newest is None
  _load(store, 5)
  assert store.acquire() == 5
  assert store.begin_load(6) is LoadDecision.PENDING and not store.admitting
  assert store.take_pending() is None
  store.release(5)
  assert store.take_pending() == 6 and store.newest is None and not store.admitting
  store.finish_load(6, "p6")
  assert store.newest == 6 and store.admitting and store.acquire() == 6


class VersionStoreMachine(RuleBasedStateMachine):
  """Drives a VersionStore like the driver: one load at a time, pins, releases."""

  @initialize(max_versions=st.integers(1, 3))
  def setup(self, max_versions):
    self.store = VersionStore(max_versions)
    self.pins: collections.Counter[int] = collections.Counter()
    self.top = 0  # highest version offered so far
    self.high = None  # highest version that has been the newest

  # ------------------------------------------------------------- loading
  @precondition(lambda self: self.store.loading is None)
  @rule(delta=st.sampled_from([1, 1, 2, 0, -1]))  # mostly new versions
  def begin_load(self, delta):
    v = max(0, self.top + delta)
    self.top = max(self.top, v)
    pending_before = self.store.pending
    decision = self.store.begin_load(v)
    if decision is LoadDecision.LOAD:
      assert self.store.loading == v
      assert self.high is None or v >= self.high
    elif decision is LoadDecision.PENDING:
      assert self.store.pending == max(v, pending_before or v)
      assert self.store.newest is not None and v > self.store.newest
    else:
      assert self.store.loading is None
      assert self.store.is_loaded(v) or (self.high is not None and v < self.high) or (
          self.store.newest is not None and v < self.store.newest)

  @precondition(lambda self: self.store.loading is None)
  @rule(delta=st.sampled_from([1, 1, 2, -1]))
  def load_version(self, delta):
    """``RolloutDriver.load_version``: begin_load, then load at once if room."""
    self.begin_load(delta)
    if self.store.loading is not None:
      self.finish_load()

  @precondition(lambda self: self.store.loading is not None)
  @rule()
  def finish_load(self):
    v = self.store.loading
    self.store.finish_load(v, f"p{v}")
    assert self.store.newest == v and self.store.params(v) == f"p{v}"

  @precondition(lambda self: self.store.loading is not None)
  @rule()
  def abort_load(self):
    self.store.abort_load(self.store.loading)
    assert self.store.loading is None

  @precondition(lambda self: self.store.loading is None)
  @rule()
  def take_pending(self):
    p = self.store.pending
    got = self.store.take_pending()
    assert got is None or (got == p and self.store.loading == p and self.store.pending is None)
    if p is not None and self._nothing_blocks():
      assert got == p, "pending version not taken although nothing pins the room"

  # ------------------------------------------------------------- pinning
  @precondition(lambda self: self.store.admitting)
  @rule()
  def acquire_newest(self):
    loaded = self.store.loaded
    v = self.store.acquire()
    assert v == max(loaded) == self.store.newest
    self.pins[v] += 1

  @precondition(lambda self: self.store.admitting)
  @rule(data=st.data())
  def acquire_specific(self, data):
    v = data.draw(st.integers(0, self.top + 1), label="version")
    if self.store.is_loaded(v):
      assert self.store.acquire(v) == v
      self.pins[v] += 1
    else:
      with pytest.raises(VersionUnavailableError):
        self.store.acquire(v)

  @precondition(lambda self: sum(self.pins.values()) > 0)
  @rule(data=st.data())
  def release(self, data):
    v = data.draw(st.sampled_from(sorted(+self.pins)), label="pinned")
    self.store.release(v)
    self.pins[v] -= 1

  @rule()
  def drain(self):
    """All slots finish: any pending version must now load."""
    if self.store.loading is not None:
      self.finish_load()
    for v, n in list(self.pins.items()):
      for _ in range(n):
        self.store.release(v)
    self.pins.clear()
    p = self.store.pending
    if p is not None:
      assert self.store.take_pending() == p
      self.store.finish_load(p, f"p{p}")
    assert self.store.pending is None
    if p is not None:
      assert self.store.newest == p

  def teardown(self):
    if hasattr(self, "store"):
      self.drain()
      assert self.store.pending is None and self.store.loading is None

  # ---------------------------------------------------------- invariants
  def _nothing_blocks(self) -> bool:
    """No pin holds back a pending load (pins on the newest only count at max_versions=1)."""
    newest = self.store.newest
    if self.store.max_versions == 1:
      return not +self.pins
    return all(v == newest for v in +self.pins)

  @invariant()
  def cap_holds(self):
    assert self.store.num_loaded <= self.store.max_versions
    assert self.store.peak_loaded <= self.store.max_versions

  @invariant()
  def newest_is_max_loaded_and_never_decreases(self):
    loaded = self.store.loaded
    newest = self.store.newest
    assert newest == (max(loaded) if loaded else None)
    if newest is None:
      # Only with one slot for params, while its replacement loads.
      assert self.high is None or (self.store.max_versions == 1 and not self.store.admitting)
    else:
      assert self.high is None or newest >= self.high
      self.high = newest
    if self.high is not None and self.store.max_versions > 1:
      assert newest is not None

  @invariant()
  def pinned_versions_stay_loaded(self):
    for v, n in (+self.pins).items():
      assert self.store.refcount(v) == n
      assert self.store.params(v) == f"p{v}"

  @invariant()
  def pending_is_ahead(self):
    p = self.store.pending
    if p is not None:
      assert self.store.newest is None or p > self.store.newest
      assert self.store.loading is None or p > self.store.loading


VersionStoreMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=30, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow])
test_version_store_state_machine = VersionStoreMachine.TestCase
