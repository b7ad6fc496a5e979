"""``config.rollout``: the rollout servers (JetStream engines) and how they are reached."""

from __future__ import annotations

import dataclasses

from jax_dora.config.block import ConfigBlock, ConfigError, choice, field
from jax_dora.config.model import check_dtype
from jax_dora.csv_fields import split_csv

LENGTH_MODES = ("eos", "answer")
DECODE_ATTENTION = ("blocked", "dense")


@dataclasses.dataclass(frozen=True)
class RolloutConfig(ConfigBlock):
  """Servers, slots, sampling, the decode kernel and liveness checks."""

  BLOCK = "rollout"

  num_servers: int = field(2, "Embedded rollout servers (role=all).")
  devices_per_server: int = field(1, "Devices of one embedded server.")
  slots: int = field(16, "Decode slots per server (max_concurrent_decodes).")
  max_prefill_length: int = field(32, "Longest prompt (tokens, with BOS).")
  max_new_tokens: int = field(56, "Longest completion.")
  length_mode: str = field(
      "eos", "eos: a rollout ends at EOS or max_new_tokens (training). answer: a rollout"
      " generates exactly len(answer) tokens, EOS ignored (vLLM's ignore_eos), so the"
      " workload's length law sets every rollout's length: benchmarks compare modes on"
      " identical work this way.")
  temperature: float = field(
      1.0, "Sampling temperature; the learner scores trajectories under logits / temperature"
      " (training needs > 0; 0 = argmax, for jax_dora.evaluate --greedy).")
  top_p: float = field(1.0, "Nucleus sampling mass, in (0, 1].")
  max_versions: int = field(3, "Policy versions a server may hold at once.")
  tensor_parallel: int = field(
      1, "Devices of one server that split the model (heads, MLP, vocab); the server's other"
      " devices split the slots.")
  decode_attention: str = field(
      "blocked", "blocked: read only the KV-cache entries below the smallest"
      " decode_length_buckets entry that holds the longest live row, in chunks of"
      " attention_block entries (online softmax). dense: score the whole cache (the old path,"
      " to measure against).")
  attention_block: int = field(
      0, "Decode attention chunk (cache entries); 0 = 2048 on a GPU/TPU, 128 on CPU.")
  decode_length_buckets: str = field(
      "", "Comma-separated bounds of the decode programs; \"\" = doubling from max(128,"
      " model.max_seq_len // 32); model.max_seq_len is always the last. Each bucket is a"
      " compiled decode program (times the multi-version pass shapes).")
  prefill_batch_tokens: int = field(
      4096, "One admission round is one batched prefill of up to this many (padded) tokens"
      " per device call.")
  share_prompt_prefill: bool = field(
      True, "Compute the identical prompts of a GRPO group once and copy their KV entries.")
  scan_layers: bool = field(
      False, "Prefill and decode programs loop over one compiled block (nn.scan) instead of"
      " unrolling model.n_layers: 1.9-2.8x less compile per program at 16-28 layers on CPU,"
      " slower below that; snapshots keep the per-layer layout (the engine stacks them on load)."
      " Measure on your accelerator (benchmarks/scan_layers.py) before turning it on.")
  param_dtype: str = field(
      "", "Dtype the servers hold the policy in (\"\" = model.param_dtype): bfloat16 halves"
      " rollout memory; snapshots are cast on restore.")
  held_kv_slots: int = field(
      -1, "Multi-turn: cache rows per server that keep a turn's keys/values while its tool"
      " runs, so the next turn prefills only its new tokens (rollout/held_kv.py); each row is"
      " one decode slot's cache (model.max_seq_len entries), allocated on the first tool call."
      " -1 = rollout.slots when tools.name is set, else 0; 0 = every turn re-prefills its"
      " whole context.")
  hold_timeout_s: float = field(
      600.0, "Multi-turn: a version hold (and its held keys/values) not taken over within"
      " this long is released (its orchestrator is gone).")
  resume_deltas: bool = field(
      True, "Remote servers, multi-turn: a next turn is sent without the context its server"
      " already holds (the prompt and the turns so far: only the observation travels) and its"
      " result comes back without it (rollout/wire_delta.py). False = every turn ships its"
      " whole context both ways.")
  port: int = field(9000, "gRPC port of a rollout server (role=rollout).")
  server_addresses: str = field(
      "", "Comma-separated host:port of remote rollout servers; empty = embedded servers.")
  health_interval_s: float = field(5.0, "Seconds between health checks of a server.")
  unhealthy_after_s: float = field(
      30.0, "A server is down after this long without a successful health check (a hung or"
      " SIGSTOPped process); its requests are re-issued elsewhere.")
  stall_timeout_s: float = field(
      300.0, "A server is down after this long without a new token while it has requests"
      " (0 = no stall check; keep it above the longest compile when precompile is off).")
  control_timeout_s: float = field(10.0, "Deadline of Status / Abort / Health calls.")
  load_timeout_s: float = field(600.0, "Deadline of one LoadVersion (and of start-up).")

  def held_kv_rows(self, multi_turn: bool) -> int:
    """``held_kv_slots`` resolved: -1 = one row per decode slot when turns call tools."""
    if self.held_kv_slots >= 0:
      return self.held_kv_slots
    return self.slots if multi_turn else 0

  @property
  def remote(self) -> bool:
    return bool(self.server_addresses.strip())

  def __post_init__(self):
    if self.temperature < 0:
      self.fail("temperature", "must be > 0 for training, or 0 for argmax decoding"
                " (jax_dora.evaluate --greedy)")
    if not 0 < self.top_p <= 1:
      self.fail("top_p", "must be in (0, 1]")
    if min(self.health_interval_s, self.unhealthy_after_s, self.control_timeout_s,
           self.load_timeout_s) <= 0 or self.stall_timeout_s < 0:
      raise ConfigError("config.rollout.health_interval_s, unhealthy_after_s, control_timeout_s"
                        " and load_timeout_s must be > 0 (stall_timeout_s >= 0)")
    choice(self.BLOCK, "decode_attention", self.decode_attention, DECODE_ATTENTION)
    choice(self.BLOCK, "length_mode", self.length_mode, LENGTH_MODES)
    if self.attention_block < 0 or self.prefill_batch_tokens < 1:
      raise ConfigError("config.rollout.attention_block must be >= 0 and prefill_batch_tokens"
                        " >= 1")
    try:
      if any(b < 1 for b in split_csv(self.decode_length_buckets, int)):
        raise ValueError("every bucket must be >= 1")
    except ValueError as e:
      raise ConfigError(
          f"config.rollout.decode_length_buckets={self.decode_length_buckets!r}: {e}") from e
    if self.held_kv_slots < -1 or self.hold_timeout_s <= 0:
      raise ConfigError("config.rollout.held_kv_slots must be >= -1 and hold_timeout_s > 0")
    if self.max_versions < 1:
      self.fail("max_versions", "must be >= 1")
    if min(self.num_servers, self.slots, self.max_prefill_length, self.max_new_tokens) < 1:
      raise ConfigError("config.rollout.num_servers, slots, max_prefill_length and"
                        " max_new_tokens must be >= 1")
    dps = self.devices_per_server
    if self.tensor_parallel < 1 or (dps > 0 and dps % self.tensor_parallel):
      self.fail("tensor_parallel", f"must divide rollout.devices_per_server={dps}")
    if self.param_dtype:
      check_dtype(self.BLOCK, "param_dtype", self.param_dtype)
