"""RL from the project's own pretrained base model: dora_pace on generated word problems.

The base model (``jax_dora/base_model/jax-dora-math-base``: a 3.3M-parameter Qwen3-architecture
decoder with its own BPE, SFT-trained by ``configs/base_model_sft.py``) solves
some held-out problems and can sometimes solve more (pass@8 well above pass@1),
which is what RL sharpens. Everything here is the real-model path: the HF
checkpoint import, the tokenizer's ChatML template, ``math_verify`` on the
``#### N`` answer; ``python -m jax_dora.export --run_dir=runs/tiny_math`` writes
the trained policy back as an HF checkpoint.

Usage::

  python -m jax_dora.train --config=configs/tiny_math.py                  # dora_pace
  python -m jax_dora.train --config=configs/tiny_math.py --config.mode=sync

Rewards and the held-out split: ``data/word_problems/rl_train.jsonl`` (other
questions than the SFT corpus) and ``test.jsonl`` (disjoint by text from both,
``jax_dora.data.word_problems``). The eval logs pass@1 at temperature 1 (mean
over ``eval.num_samples`` samples) and splits it by difficulty. The settings
live in the package (:func:`jax_dora.base_model.rl_recipe.tiny_math_config`),
where the Colab notebook reads them too; the measurements that chose them are
written there.
"""

from jax_dora.base_model.rl_recipe import tiny_math_config


def get_config():
  return tiny_math_config()
