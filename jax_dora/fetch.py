"""Download a model checkpoint and/or a math dataset from the Hugging Face Hub, once.

Training never downloads anything: this script puts the files where the
recipes expect them (``checkpoints/<name>``, ``data/<dataset>/``), after
which runs are offline. Needs internet and ``huggingface_hub`` (installed
with ``transformers``).

  python -m jax_dora.fetch --model=Qwen/Qwen2.5-0.5B-Instruct --dataset=gsm8k --out=.

Datasets are fetched as the Hub's Parquet files, which ``data.train_files``
reads directly (``data.format`` names the field mapping).
"""

from __future__ import annotations

import argparse
import os
import shutil

# dataset -> (hub repo, {local file: file in the repo})
DATASETS = {
    "gsm8k": ("openai/gsm8k", {"train.parquet": "main/train-00000-of-00001.parquet",
                               "test.parquet": "main/test-00000-of-00001.parquet"}),
    "math500": ("HuggingFaceH4/MATH-500", {"test.jsonl": "test.jsonl"}),
}
MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.jinja", "tokenizer.model"]


def fetch_model(repo: str, out: str) -> str:
  from huggingface_hub import snapshot_download  # pylint: disable=g-import-not-at-top

  dest = os.path.join(out, "checkpoints", repo.split("/")[-1])
  snapshot_download(repo, local_dir=dest, allow_patterns=MODEL_FILES)
  return dest


def fetch_dataset(name: str, out: str) -> str:
  from huggingface_hub import hf_hub_download  # pylint: disable=g-import-not-at-top

  repo, files = DATASETS[name]
  dest = os.path.join(out, "data", name)
  os.makedirs(dest, exist_ok=True)
  for local, remote in files.items():
    path = hf_hub_download(repo, remote, repo_type="dataset")
    shutil.copyfile(path, os.path.join(dest, local))
  return dest


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", default="", help="Hub model id, e.g. Qwen/Qwen2.5-0.5B-Instruct")
  ap.add_argument("--dataset", default="", choices=["", *DATASETS])
  ap.add_argument("--out", default=".", help="root under which checkpoints/ and data/ go")
  args = ap.parse_args(argv)
  if not args.model and not args.dataset:
    ap.error("nothing to fetch: pass --model and/or --dataset")
  if args.model:
    print("model ->", fetch_model(args.model, args.out))
  if args.dataset:
    print("dataset ->", fetch_dataset(args.dataset, args.out))


if __name__ == "__main__":
  main()
