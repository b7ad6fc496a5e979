"""A randomly initialised Hugging Face checkpoint: where the base model's SFT starts.

SFT (``python -m jax_dora.sft``) reads its policy like every run does, from
``model.hf_path``, so the from-scratch base model starts as an HF directory
too: the tokenizer files plus random weights of a Qwen3-architecture decoder
(QK-norm, grouped-query attention, tied embeddings), drawn by the learner's
own init and written by the exporter (``jax_dora.model.hf_export``). The
whole way from init to RL is then the real Hugging Face path, and
``transformers`` can load every stage.
"""

from __future__ import annotations

import json
import os

# The shipped base model's architecture. Sized by measuring SFT throughput on
# the 2-core CPU (README, "The base model"): ~3.3M parameters, 13 MB in
# float32, small enough to commit and to train in about half an hour.
ARCHITECTURE = dict(d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=768,
                    qk_norm=True, tie_embeddings=True, rope_theta=10000.0, norm_eps=1e-6)
# Embedding rows: the tokenizer's ids rounded up to a multiple of 64, as HF
# checkpoints pad them (the padded rows are never sampled).
VOCAB_MULTIPLE = 64
EMBEDDING_STD = 0.02


def write_initial_checkpoint(tokenizer_dir: str, out_dir: str, *, seed: int = 0,
                             max_seq_len: int = 256, architecture: dict | None = None,
                             overwrite: bool = False) -> str:
  """Random weights of ``architecture`` (default :data:`ARCHITECTURE`) in ``out_dir``.

  The vocabulary is the tokenizer's length rounded up to
  :data:`VOCAB_MULTIPLE`; the tokenizer and generation-config files are
  copied beside the weights.
  """
  import jax  # pylint: disable=g-import-not-at-top

  from jax_dora.model import ModelConfig, init_key, init_params  # pylint: disable=g-import-not-at-top
  from jax_dora.model.hf_export import export_hf  # pylint: disable=g-import-not-at-top
  from jax_dora.model.hf_lib import import_transformers  # pylint: disable=g-import-not-at-top

  tok = import_transformers().AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
  vocab = -(-len(tok) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
  cfg = ModelConfig(vocab_size=vocab, max_seq_len=max_seq_len,
                    **(ARCHITECTURE if architecture is None else architecture))
  params = jax.jit(init_params, static_argnums=0)(cfg, init_key(seed))
  if cfg.tie_embeddings:
    # The native init draws the embedding at std 1 (right for an input table);
    # tied, it is also the output head, and logits of std sqrt(d_model) start
    # the cross-entropy near 40 nats. HF's initializer_range (0.02) instead.
    params["embed"]["embedding"] = params["embed"]["embedding"] * EMBEDDING_STD
  export_hf(params, cfg, out_dir, tokenizer_dir=tokenizer_dir, dtype="float32",
            overwrite=overwrite)
  gen = os.path.join(tokenizer_dir, "generation_config.json")
  if os.path.exists(gen):
    with open(gen) as f, open(os.path.join(out_dir, "generation_config.json"), "w") as g:
      json.dump(json.load(f), g, indent=2)
  return out_dir


def parameter_count(architecture: dict, vocab_size: int) -> int:
  """Parameters of a dense decoder of ``architecture`` (tied embeddings counted once)."""
  from jax_dora.model import ModelConfig, abstract_params  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import math  # pylint: disable=g-import-not-at-top

  cfg = ModelConfig(vocab_size=vocab_size, **architecture)
  return sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_params(cfg)))


__all__ = ["ARCHITECTURE", "parameter_count", "write_initial_checkpoint"]
