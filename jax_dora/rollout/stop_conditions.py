"""When a slot's generation ends: a stop id, its token budget, or a stop string.

* **Stop ids**: every stop id of the tokenizer ends a completion (HF chat
  models have several: Llama 3 Instruct's ``<|eot_id|>`` besides
  ``<|end_of_text|>``), unless the request ignores EOS (benchmarks fix
  lengths) or the server runs with ``stop_on_eos=False``.
* **Budget**: ``max_new_tokens`` minus the resumed prefix, capped by the cache.
* **Stop strings** (multi-turn: a tool call's end marker): only sampling a
  token whose text holds a stop string's last character can complete one, so
  the decoded tail is checked for those tokens alone (``triggers``), not every
  token of every slot. The completion keeps the completing token.

Checks are vectorised over the slots that received a token in a step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jax_dora.model.tokenizer import PolicyTokenizer


class StopConditions:
  """The stop rules of one server's tokenizer."""

  def __init__(self, tokenizer: PolicyTokenizer, stop_on_eos: bool = True):
    self.tokenizer = tokenizer
    self.stop_ids = frozenset(int(t) for t in tokenizer.stop_tokens) if stop_on_eos else frozenset()
    self._stop_arr = np.asarray(sorted(self.stop_ids), np.int32)
    self._triggers: dict[tuple[str, ...], frozenset[int]] = {}

  def ended(self, tokens: np.ndarray, counts: np.ndarray, budgets: np.ndarray,
            ignore_eos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(eos, full)`` masks over slots that just sampled ``tokens``: a stop id
    (unless ignored), or the slot's ``counts`` reached its budget."""
    eos = np.isin(tokens, self._stop_arr) & ~ignore_eos
    return eos, counts >= budgets

  def triggers(self, stop_strings: Sequence[str]) -> frozenset[int]:
    """Token ids whose text holds the last character of a stop string (cached)."""
    if not stop_strings:
      return frozenset()
    key = tuple(stop_strings)
    if key not in self._triggers:
      last = {s[-1] for s in key if s}
      self._triggers[key] = frozenset(
          i for i in range(self.tokenizer.vocab_size) if last & set(self.tokenizer.decode([i])))
    return self._triggers[key]

  def completes_stop_string(self, tokens: np.ndarray, stop_strings: Sequence[str]) -> bool:
    """Whether the last of ``tokens`` (a slot's sampled tokens) completed a stop string."""
    width = max(len(x) for x in stop_strings) + 1
    tail = np.asarray(tokens[max(0, len(tokens) - width):]).tolist()
    now, before = self.tokenizer.decode(tail), self.tokenizer.decode(tail[:-1])
    return any(x and x in now and x not in before for x in stop_strings)
