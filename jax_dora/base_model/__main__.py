"""``python -m jax_dora.base_model``: the word problems, the tokenizer and the initial checkpoint.

The first half of the recipe of the shipped base model (``jax_dora/base_model``); the
second is ``python -m jax_dora.sft --config=configs/base_model_sft.py``.
Deterministic: the same command writes the same files (the data is a function
of its seeds, BPE training is deterministic on the same corpus, the random
init is the learner's seeded draw).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time

from jax_dora.data import word_problems


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--data", default="data/word_problems", help="Where the JSONL files go.")
  parser.add_argument("--init", default="runs/base_model/init",
                      help="Where the tokenizer and the random initial checkpoint go.")
  parser.add_argument("--tokenizer", default="runs/base_model/tokenizer",
                      help="Where the trained tokenizer goes (copied into --init too).")
  parser.add_argument("--scale", type=float, default=1.0,
                      help="Multiply every split's row count (tests write small files).")
  parser.add_argument("--tokenizer_rows", type=int, default=4000,
                      help="SFT rows (question and answer) the BPE is trained on.")
  parser.add_argument("--vocab_size", type=int, default=1024, help="BPE vocabulary limit.")
  parser.add_argument("--seed", type=int, default=0, help="Seed of the random init.")
  parser.add_argument("--architecture", default="",
                      help="JSON dict replacing the default architecture (tests: a smaller one).")
  args = parser.parse_args(argv)

  from jax_dora.base_model.init import write_initial_checkpoint  # pylint: disable=g-import-not-at-top
  from jax_dora.base_model.tokenizer import train_tokenizer  # pylint: disable=g-import-not-at-top

  t0 = time.time()
  word_problems.main([f"--out={args.data}", f"--scale={args.scale}"])
  sft = os.path.join(args.data, "sft_train.jsonl")
  with open(sft) as f:
    rows = [json.loads(line) for line in itertools.islice(f, args.tokenizer_rows)]
  tok_dir = args.tokenizer
  train_tokenizer((t for r in rows for t in (r["question"], r["answer"])), tok_dir,
                  vocab_size=args.vocab_size)
  arch = json.loads(args.architecture) if args.architecture else None
  write_initial_checkpoint(tok_dir, args.init, seed=args.seed, architecture=arch, overwrite=True)
  print(f"{args.init}: tokenizer and random initial checkpoint ({time.time() - t0:.0f}s in all)")


if __name__ == "__main__":
  main()
