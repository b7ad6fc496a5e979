#!/usr/bin/env bash
# Issue 23's GPU checks as one device run (see the device tool's README):
#   scripts/device_wheels.sh here, then run `bash scripts/accelerator_check.sh`
#   on the device with carry [".whl"]. Writes under $OUT: the GPU's exactness
#   tests, benchmarks/accelerator.py's tables and JSON per shape, and the
#   jax.profiler trace of one decode loop and one learner step (profile.tgz).
# Sized for ~8 minutes of a 15-minute device budget; SHAPES / SECTIONS / the
# timeouts below trim it. A CPU dry run of the script itself:
#   SKIP_WHEELS=1 ACC_ARGS=--small SHAPES= PATH=.venv/bin:$PATH bash scripts/accelerator_check.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT="${OUT:-/tmp/accelerator_out}"
mkdir -p "$OUT"
if [ -z "${SKIP_WHEELS:-}" ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PWD"
fi
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=3
unset JAX_PLATFORMS XLA_FLAGS
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
python3 -c "import jax; print(jax.__version__, jax.devices())" 2>&1 | tee "$OUT/env.txt"

# 1. Exactness on the accelerator: every decode program against the full
#    forward (multi-version, bounded attention, head-major cache), float32 at
#    full matmul precision (TF32 would test the hardware's rounding, not us).
JAX_DEFAULT_MATMUL_PRECISION=highest timeout "${TEST_TIMEOUT:-180}" \
  python3 -m pytest -q -p no:cacheprovider tests/test_rollout_engine.py 2>&1 | tail -30 \
  > "$OUT/tests.txt"

# 2. The benchmark: 0.5B every section (with profiles), then the larger shapes.
# shellcheck disable=SC2086  # ACC_ARGS is a word list
timeout "${BENCH_TIMEOUT:-300}" python3 benchmarks/accelerator.py --shape 0.5b ${ACC_ARGS:-} \
  --json "$OUT/acc_0.5b.json" --profile /tmp/prof 2>&1 | tail -60 > "$OUT/acc_0.5b.txt"
tar czf "$OUT/profile.tgz" -C /tmp prof 2>/dev/null
# The MoE block's grouped matmul against its floor (issue 26: ragged_dot is
# expanded per expert on CPU; this is where a grouped kernel shows, or not).
timeout "${MOE_TIMEOUT:-60}" python3 benchmarks/moe_grouped_matmul.py \
  --json "$OUT/moe_grouped_matmul.json" 2>&1 | tail -8 > "$OUT/moe_grouped_matmul.txt"
for shape in ${SHAPES-1.5b 7b}; do
  timeout "${BIG_TIMEOUT:-120}" python3 benchmarks/accelerator.py --shape "$shape" \
    --sections "${SECTIONS:-env,decode,learner}" --slots 64 --versions 1,2 \
    --json "$OUT/acc_$shape.json" 2>&1 | tail -40 > "$OUT/acc_$shape.txt"
done
cat "$OUT"/tests.txt "$OUT"/acc_*.txt
