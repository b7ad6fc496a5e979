"""Process helpers the benchmarks share (tests have theirs in tests/_harness.py)."""

from __future__ import annotations

import json
import pathlib
import socket
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def free_port() -> int:
  """A TCP port free on the loopback right now (for a rollout server subprocess)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def evaluate_versions(run_dir: pathlib.Path, versions: list[int], *, num_prompts: int,
                      num_samples: int, greedy: bool, out: pathlib.Path,
                      env: dict[str, str]) -> dict[int, dict]:
  """``python -m jax_dora.evaluate --steps`` of ``versions`` in one process (its own
  servers): ``{version: metrics}``, written to ``out``; its log is appended to
  ``run_dir/evaluate.log``. Exits the benchmark if the evaluation fails."""
  proc = subprocess.run(
      [sys.executable, "-m", "jax_dora.evaluate", f"--run_dir={run_dir}",
       f"--steps={','.join(map(str, versions))}", f"--num_prompts={num_prompts}",
       f"--num_samples={1 if greedy else num_samples}", f"--greedy={greedy}", f"--out={out}"],
      cwd=ROOT, env=env, capture_output=True, text=True)
  with open(pathlib.Path(run_dir) / "evaluate.log", "a") as log:
    log.write(proc.stdout + proc.stderr)
  if proc.returncode != 0:
    sys.stderr.write(proc.stderr[-4000:])
    raise SystemExit(f"evaluating {run_dir} failed with exit code {proc.returncode}")
  return {o["step"]: o for o in json.loads(pathlib.Path(out).read_text())}
