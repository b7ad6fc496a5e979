"""The Colab demo notebook executes end to end on a reduced budget."""

from __future__ import annotations

import os
import pathlib

import nbformat
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_colab_notebook_runs(tmp_path, monkeypatch):
  monkeypatch.setenv("JAX_DORA_NOTEBOOK_BUDGET_S", "25")
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
  for mode in ("dora_pace", "sync"):
    assert (tmp_path / mode / "metrics.jsonl").stat().st_size > 0
