"""The streaming producer: keeps rollout servers busy within the staleness bound.

The streaming modes never stop generating: this task issues one GRPO group
at a time whenever the admission rule allows, and streams every finished
trajectory into the pool, where the learner picks up batches of complete
groups. What it must get right is *how much* to keep in flight (see
:meth:`StreamingProducer.may_issue`).
"""

from __future__ import annotations

import asyncio

from jax_dora.orchestrator.host import ModeHost
from jax_dora.types import Prompt, Trajectory


class StreamingProducer:
  """Issues groups while the admission rule allows; finished members go to the pool."""

  def __init__(self, host: ModeHost, *, interruptible: bool, queue_depth: int,
               fill_staleness_budget: bool = False):
    self.host = host
    self.interruptible = interruptible
    # Requests in flight per server beyond its slots (orchestrator.queue_depth).
    self.queue_depth = queue_depth
    # Drop the working-set cap (orchestrator.fill_staleness_budget).
    self.fill_staleness_budget = fill_staleness_budget
    self.in_flight = 0  # rollout requests issued and not yet finished
    self.cond = asyncio.Condition()
    # The servers' slot + queue capacity it keeps busy (None: unknown).
    self.rollout_capacity: int | None = None

  def capacity_samples(self) -> int:
    """Outstanding samples allowed: enough to keep slots busy, never more than
    can be consumed before exceeding the staleness bound (AReaL's rule).

    A request issued now starts on a version at best as new as the newest
    *published* one, which lags the learner while a background publish is in
    flight; that lag is already spent of the bound, so it shrinks the budget.
    """
    o = self.host
    batch = o.groups_per_step * o.group_size
    lag = max(0, o.version - o.published_version)
    return max(1, o.max_staleness + 1 - lag) * batch

  async def count_rollout_slots(self) -> None:
    """Decode slots (+ ``queue_depth`` per server) the producer keeps busy."""
    o = self.host
    slots = servers = 0
    for c in o.dispatcher.live_clients:
      try:
        slots += int((await c.status()).total_slots)
        servers += 1
      except Exception:  # pylint: disable=broad-exception-caught
        continue
    self.rollout_capacity = slots + self.queue_depth * servers if servers else None

  def may_issue(self) -> bool:
    """Admission rule for one more group.

    Two caps: AReaL's hard rule (in flight + everything pooled <=
    ``(max_staleness + 1) * batch``), and a working-set cap: in flight plus
    *complete* pooled groups <= one batch + the servers' slots and queues.
    Work beyond the second cap could only wait in a queue or in the pool while
    versions advance, to be evicted as stale; below it every slot stays busy
    and the learner finds its next batch ready. Counting requests rather than
    whole unfinished groups matters under long tails: a group whose short
    members are done and whose long one still runs holds one slot, not
    ``group_size`` (counted as a group, such groups starved the servers of
    work: ~30% of their slot time idle). ``orchestrator.fill_staleness_budget``
    drops the second cap, to study high staleness on purpose.
    """
    o = self.host
    g = o.group_size
    if self.in_flight + o.pool.num_trajectories() + g > self.capacity_samples():
      return False
    cap = self.rollout_capacity
    if cap is None or self.fill_staleness_budget:
      return True
    batch = o.groups_per_step * g
    return self.in_flight + o.pool.num_complete_groups() * g + g <= batch + max(cap, g)

  def kick(self) -> None:
    """Wakes the producer to re-check the admission rule."""
    cond = self.cond

    async def notify():
      async with cond:
        cond.notify_all()

    self.host.spawn(notify())

  async def run(self) -> None:
    o = self.host
    await self.count_rollout_slots()
    while not o.stopping:
      async with self.cond:
        await self.cond.wait_for(lambda: o.stopping or self.may_issue())
      if o.stopping:
        break
      p = o.next_prompt()
      self.in_flight += o.group_size
      o.spawn(self._group(p))
      await asyncio.sleep(0)

  async def _member(self, p: Prompt, m: int) -> Trajectory:
    try:
      return await self.host.rollout_member(p, m, None, interruptible=self.interruptible)
    finally:
      self.in_flight -= 1
      self.kick()

  async def _group(self, p: Prompt) -> None:
    o = self.host
    members: list[asyncio.Task] = []
    try:
      members = [asyncio.create_task(self._member(p, m)) for m in range(o.group_size)]
      for fut in asyncio.as_completed(members):
        t = await fut
        if t.finish_reason == "aborted":
          continue
        o.add_to_pool(t)
    except asyncio.CancelledError:
      raise
    except Exception as e:  # pylint: disable=broad-exception-caught
      # E.g. every rollout server is gone: stop the run loudly instead of
      # spinning on prompts that can never be generated.
      for m in members:
        m.cancel()
      o.fail(e)
