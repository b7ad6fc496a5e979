"""Output assembly: what a request's callback receives, built from its slot's tokens.

A request may continue an earlier completion (``resume_*``: an interrupted
rollout, or the turns before a tool call). Its :class:`~jax_dora.rollout.api.ResumeParts`
are derived once, at admission, and every result the request can end with (a
finished span, an abort before admission, "nothing left to generate") is
built from them here: the whole completion so far, its log-probs, and the
version span of every part.
"""

from __future__ import annotations

import numpy as np

from jax_dora.rollout import api
from jax_dora.rollout.api import ResumeParts
from jax_dora.types import TokenSpan


def span_result(request_id: str, resume: ResumeParts, tokens: np.ndarray, logprobs: np.ndarray,
                reason: str, version: int, incarnation: str,
                routes: np.ndarray | None = None) -> api.RolloutResult:
  """The result of a span that sampled ``tokens`` on ``version`` after ``resume``."""
  spans = resume.spans
  if len(tokens):
    spans = spans + (TokenSpan(len(resume), len(resume) + len(tokens), version),)
  return api.RolloutResult(
      request_id=request_id,
      completion_tokens=np.concatenate([resume.tokens, tokens]),
      logprobs=np.concatenate([resume.logprobs, logprobs]),
      spans=spans,
      finish_reason=reason,
      prefill_version=version,
      incarnation=incarnation,
      routing=resume.routing if routes is None else routes,
  )


def unstarted_result(req: api.RolloutRequest, reason: str, incarnation: str,
                     version: int = -1) -> api.RolloutResult:
  """A request that ends without sampling: aborted while queued (``version`` -1), or
  resumed with no budget left. Its completion is what it came with."""
  resume = ResumeParts.of(req)
  return span_result(req.request_id, resume, np.zeros((0,), np.int32), np.zeros((0,), np.float32),
                     reason, version, incarnation)
