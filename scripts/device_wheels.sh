#!/usr/bin/env bash
# Downloads, into .whl/ (git-ignored), the Python 3.12 x86-64 wheels a GPU
# host needs beyond its own jax / flax / optax / orbax / transformers / torch
# image, pinned to the versions the CPU venv resolves. No TensorFlow or seqio:
# jax_dora imports JetStream's API without them (google-jetstream --no-deps).
# On the host: pip install --no-index --no-deps --target /tmp/site .whl/*.whl
# and PYTHONPATH=/tmp/site (scripts/accelerator_check.sh does both).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
PKGS=(
  grain==0.2.18 array_record==0.8.6 dm-tree==0.1.10
  ml_collections==1.1.0 google-jetstream==0.2.2 Pebble==5.2.3
  math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
  tensorboardX==2.6.5 portpicker==1.6.0
)
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64 manylinux_2_24_x86_64 manylinux_2_31_x86_64 any; do
  PLATFORMS+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d .whl "${PKGS[@]}"
ls -la .whl
