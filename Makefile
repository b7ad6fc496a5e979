# The README's two commands live here so that CI and humans run exactly the same thing.
PY ?= python
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8
export JAX_PLATFORMS ?= cpu
export TF_CPP_MIN_LOG_LEVEL ?= 3

.PHONY: test test-slow train bench docs wheel

test:
	$(PY) -m pytest -q -x --timeout=900 --durations=60 tests

test-slow:
	$(PY) -m pytest -q -m slow --timeout=3600 tests

train:
	$(PY) -m jax_dora.train --config=configs/tiny_math.py

bench:
	$(PY) benchmarks/modes.py

docs:
	$(PY) scripts/gen_config_reference.py > docs/CONFIG_REFERENCE.md

# A wheel of this checkout (dist/jax_dora-*.whl): what the Colab notebook installs.
wheel:
	$(PY) -m pip wheel --no-deps --no-build-isolation -w dist .
