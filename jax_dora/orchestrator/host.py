"""The interfaces between the orchestrator, its modes and the parts it drives.

Written as :class:`typing.Protocol` s so that imports run one way
(``runner`` -> ``modes`` -> ``streaming`` -> this file, never back) and so
that every part can be replaced by a fake in a test: the mode strategies are
tested in milliseconds against a fake learner, publisher and rollout client
(``tests/test_mode_strategies.py``) beside the end-to-end runs on the real
ones. Nothing here imports JAX.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, Protocol

from jax_dora.types import Prompt, Trajectory


class TrainerLike(Protocol):
  """What the orchestrator needs from the learner (``jax_dora.learner.Learner``)."""

  @property
  def step(self) -> int:
    """Optimizer steps taken; the version the next publish will carry."""

  @property
  def params(self) -> Any:
    ...

  def train_step(self, batch: dict[str, Any]) -> dict[str, float]:
    """One optimizer step (blocking; the orchestrator runs it on a thread)."""

  def detached_params(self, version: int | None = None, dtype: str | None = None) -> Any:
    """A copy of the params a background publish may read while training goes on
    (floating leaves in ``dtype``, the publisher's write dtype, when given)."""

  # An MoE policy's recorded-routing spec ``((moe_layers, k), dtype)``
  # (``learner.train_state.routing_spec``): batches then carry the rollout's
  # routes. None for a dense policy.
  routing: Any


class PublisherLike(Protocol):
  """What the orchestrator needs from the snapshot store (``SnapshotPublisher``)."""

  def publish(self, version: int, params: Any, metadata: dict[str, Any],
              owned: bool = False) -> Any:
    """Writes ``version`` where the rollout servers load it from (blocking)."""


class ScorerLike(Protocol):
  """Rewards (``jax_dora.rewards.RewardScorer``): verifiers may run in worker processes."""

  async def score(self, prompt: Prompt, completion: str) -> float:
    ...

  def metrics(self) -> dict[str, Any]:
    """Verifier timeouts / crashes / errors so far."""


class PoolView(Protocol):
  """The parts of the trajectory pool a producer's admission rule reads."""

  def num_trajectories(self) -> int:
    ...

  def num_complete_groups(self) -> int:
    ...


class ModeHost(Protocol):
  """What a mode strategy drives: the orchestrator's shared steps.

  A mode decides *when* rollouts are generated and *which* version they may
  use; everything else (prompts, the pool, the learner step, publishing,
  metrics, checkpoints) stays behind these members.
  """

  group_size: int
  groups_per_step: int
  max_staleness: int
  stopping: bool
  pool: PoolView
  dispatcher: Any  # jax_dora.orchestrator.dispatch.Dispatcher

  @property
  def version(self) -> int:
    """Newest version the learner produced."""

  @property
  def published_version(self) -> int:
    """Newest version written for the servers (lags ``version`` in background)."""

  @property
  def publish_in_background(self) -> bool:
    ...

  def steps_left(self) -> bool:
    """Whether another learner step fits in the run's step and time budget."""

  def is_last_step(self) -> bool:
    """Whether the step about to be trained is the run's last by step count."""

  def next_prompt(self) -> Prompt:
    ...

  async def rollout_member(self, prompt: Prompt, member: int, version: int | None, *,
                           interruptible: bool) -> Trajectory:
    ...

  async def generate_batch(self, version: int | None) -> list[list[Trajectory]]:
    ...

  def add_to_pool(self, t: Trajectory) -> None:
    ...

  async def wait_batch(self) -> list[list[Trajectory]]:
    ...

  async def train(self, groups: list[list[Trajectory]], *, wait_s: float) -> dict[str, Any]:
    ...

  async def on_published(self, version: int) -> None:
    ...

  async def after_learner_step(self, rec: dict[str, Any]) -> None:
    ...

  def spawn(self, coro: Awaitable[Any]) -> asyncio.Task:
    ...

  def request_stop(self) -> None:
    ...

  def fail(self, err: BaseException) -> None:
    ...

