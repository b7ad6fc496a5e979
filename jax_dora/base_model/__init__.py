"""The project's own small pretrained model: tokenizer, initial checkpoint, recipe.

Nothing can be downloaded where jax-dora is built, so RL starts from a base
model the project makes itself, the way users make one: a byte-level BPE
tokenizer trained on the word-problem corpus (:mod:`tokenizer`), a randomly
initialised Qwen3-architecture Hugging Face checkpoint (:mod:`init`), then
supervised fine-tuning with ``python -m jax_dora.sft`` (the same learner as
RL). ``python -m jax_dora.base_model`` writes the data, tokenizer and initial
checkpoint; ``configs/base_model_sft.py`` is the SFT run that produced the
committed :data:`SHIPPED_MODEL`.
"""

import os

# The shipped base model: an HF directory inside the package (so a wheel has
# it too), what ``configs/tiny_math.py``'s ``model.hf_path`` points at.
SHIPPED_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jax-dora-math-base")
