"""The Colab demo notebook (RL from the shipped base model) executes end to end on a reduced budget."""

from __future__ import annotations

import os
import pathlib

import nbformat
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_colab_notebook_runs(tmp_path, monkeypatch):
  monkeypatch.setenv("JAX_DORA_NOTEBOOK_BUDGET_S", "15")
  monkeypatch.setenv("JAX_DORA_NOTEBOOK_PRECOMPILE", "0")
  monkeypatch.setenv("JAX_DORA_NOTEBOOK_EVAL_PROMPTS", "16")
  monkeypatch.setenv("JAX_DORA_NOTEBOOK_OUT", str(tmp_path))
  monkeypatch.setenv("MPLBACKEND", "Agg")
  nb = nbformat.read(ROOT / "colab" / "jax_dora_demo.ipynb", as_version=4)
  # Raises CellExecutionError (failing the test) if any cell errors.
  NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
  outputs = "".join(
      o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
  )
  assert "dora_pace / sync throughput" in outputs
  assert "integrity violations: 0" in outputs
  assert outputs.count("held-out pass@1") == 2  # RL from the shipped base model, both modes
  for mode in ("dora_pace", "sync"):
    assert (tmp_path / mode / "metrics.jsonl").stat().st_size > 0


def test_notebook_installs_a_wheel_built_from_the_checkout(tmp_path):
  """The install cell names no placeholder URL, and the wheel it installs builds and holds the CLIs."""
  import shutil  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  import zipfile  # pylint: disable=g-import-not-at-top

  nb = nbformat.read(ROOT / "colab" / "jax_dora_demo.ipynb", as_version=4)
  install = nb.cells[1].source
  assert "jax_dora-*.whl" in install and "github.com/jax-dora" not in install
  # pip builds in the source tree (build/, *.egg-info): build a copy, not the checkout.
  src = tmp_path / "src"
  shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
      ".git", ".venv", "runs", "build", "dist", "*.egg-info", "__pycache__", ".ruff_cache"))
  proc = subprocess.run(
      [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
       "-w", str(tmp_path / "dist"), str(src)],
      cwd=tmp_path, capture_output=True, text=True, check=False, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  (whl,) = (tmp_path / "dist").glob("jax_dora-*.whl")
  with zipfile.ZipFile(whl) as z:
    names = set(z.namelist())
    (entry_points,) = [n for n in names if n.endswith("entry_points.txt")]
    scripts = z.read(entry_points).decode()
  assert {"jax_dora/report.py", "jax_dora/evaluate.py", "jax_dora/train.py"} <= names
  assert "jax-dora-report = jax_dora.report:main" in scripts
