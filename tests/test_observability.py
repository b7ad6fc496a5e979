"""The main job as a user meets it: quiet start, dashboards, summary, report, evaluate.

One short run of the README's main command (``python -m jax_dora.train
--config=configs/tiny.py``, dora_pace by default) in a fresh-clone
environment is shared by every check here: its first screen, its TensorBoard
event files read back with TensorBoard's own reader, its offline W&B run, its
summary, and the report and evaluate commands on its output directory.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from jax_dora.metrics.jsonl import read_metrics

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS = 3
# What TensorFlow's CUDA stubs and absl's C++ logging print when TensorFlow is imported.
NOISE = re.compile(r"cuda|cuinit|tensorflow|absl::initializelog|cudart|tf-trt|gpu will not",
                   re.IGNORECASE)


def _fresh_env() -> dict[str, str]:
  """This session's environment minus what the Makefile and tests set to quiet things."""
  env = {k: v for k, v in os.environ.items()
         if k not in ("TF_CPP_MIN_LOG_LEVEL", "JAX_PLATFORMS", "XLA_FLAGS")
         and not k.startswith("WANDB_")}
  env["PYTHONUNBUFFERED"] = "1"
  return env


def _run_on_a_terminal(args: list[str], timeout_s: float) -> tuple[int, str]:
  """Runs ``args`` with stdout and stderr on a pseudo-terminal: what a user's screen shows.

  A terminal, not a pipe, because the CLI draws its progress bar (and keeps
  log lines off the screen) only there.
  """
  import fcntl  # pylint: disable=g-import-not-at-top
  import pty  # pylint: disable=g-import-not-at-top
  import select  # pylint: disable=g-import-not-at-top
  import struct  # pylint: disable=g-import-not-at-top
  import termios  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top

  master, slave = pty.openpty()
  fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
  proc = subprocess.Popen(args, cwd=ROOT, env=_fresh_env(), stdin=subprocess.DEVNULL,
                          stdout=slave, stderr=slave, close_fds=True)
  os.close(slave)
  chunks, deadline = [], time.time() + timeout_s
  try:
    while time.time() < deadline:
      if select.select([master], [], [], 1.0)[0]:
        try:
          data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
          break
        if not data:
          break
        chunks.append(data)
      elif proc.poll() is not None:
        break
    else:
      proc.kill()
      raise AssertionError(f"the main job ran past {timeout_s}s")
    return proc.wait(timeout=60), b"".join(chunks).decode(errors="replace")
  finally:
    os.close(master)
    if proc.poll() is None:
      proc.kill()


@pytest.fixture(scope="module")
def main_run(tmp_path_factory):
  """(output dir, what the terminal showed) of one short run of the README's main command."""
  out = tmp_path_factory.mktemp("main") / "run"
  rc, screen = _run_on_a_terminal(
      [sys.executable, "-m", "jax_dora.train", "--config=configs/tiny.py",
       "--config.precompile=False",
       f"--config.output_dir={out}", f"--config.total_steps={STEPS}",
       "--config.learner.groups_per_step=4", "--config.learner.group_size=4",
       "--config.eval.num_prompts=4", "--config.eval.num_samples=2", "--config.eval.every_steps=0",
       "--config.metrics.text_every_steps=1", "--config.metrics.wandb_project=jax-dora-test",
       "--config.metrics.wandb_mode=offline"], timeout_s=600)
  assert rc == 0, screen[-3000:]
  return out, screen


def test_first_screen_has_no_tensorflow_or_cuda_noise(main_run):
  _, screen = main_run
  # Lines as a terminal shows them (the bar redraws itself with \r).
  first = screen.splitlines()[:20]
  assert not [line for line in first if NOISE.search(line)], first
  # Quiet: the bar and the summary, no log lines (they are for --verbosity or a log file).
  assert not [line for line in screen.splitlines() if re.search(r" [IW] jax_dora", line)], screen
  assert any(line.startswith("dora_pace:") and "step" in line for line in first), first


def test_main_job_runs_dora_pace_and_prints_the_summary(main_run):
  out, text = main_run
  summary = json.loads((out / "summary.json").read_text())
  assert summary["mode"] == "dora_pace" and summary["steps"] == STEPS
  assert f"== dora_pace: {STEPS} steps" in text
  for label in ("trained tokens/s", "learner bubble", "staleness p50/p99  generation",
                "rejected groups    PACE", "eval reward", "integrity          OK"):
    assert label in text, text
  assert f"tensorboard --logdir {out}/tensorboard" in text
  assert f"plot               {out}/report.png" in text
  # pass@k of the final eval is in the summary, with its standard error.
  assert {"eval/pass@1", "eval/pass@2", "eval/maj@2", "eval/pass@1_stderr"} <= set(
      summary["final_eval"])


def test_tensorboard_event_files_hold_scalars_histograms_and_text(main_run):
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # pylint: disable=g-import-not-at-top

  out, _ = main_run
  recs = read_metrics(out / "metrics.jsonl")
  acc = EventAccumulator(str(out / "tensorboard"),
                         size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
  acc.Reload()
  tags = acc.Tags()
  for tag in ("reward_mean", "trained_tokens_per_s", "bubble_ratio", "train/loss",
              "staleness_generation/mean", "staleness_waiting/max", "staleness_effective/mean",
              "pace_rejected_total", "pace/pace_budget", "wasted_rollout_frac"):
    assert tag in tags["scalars"], (tag, sorted(tags["scalars"]))
  # The scalars are the JSONL's numbers, step by step.
  got = {e.step: e.value for e in acc.Scalars("reward_mean")}
  assert got == pytest.approx({r["step"]: r["reward_mean"] for r in recs})
  assert [e.step for e in acc.Scalars("bubble_ratio")] == list(range(1, STEPS + 1))
  # Staleness distributions are histograms whose buckets are the JSONL counts.
  for key in ("staleness_generation", "staleness_waiting", "staleness_behaviour"):
    assert key in tags["histograms"]
    for ev, rec in zip(acc.Histograms(key), recs):
      h = ev.histogram_value
      counts = {int(k): v for k, v in rec[key].items() if k.isdigit()}
      assert list(h.bucket) == [counts[b] for b in sorted(counts)]
      assert list(h.bucket_limit) == [b + 0.5 for b in sorted(counts)]
      assert h.num == rec[key]["n"] == 16
  # Decoded completions as text, one table per step.
  (text_tag,) = [t for t in tags["tensors"] if t.startswith("samples")]
  texts = acc.Tensors(text_tag)
  assert len(texts) == STEPS
  table = texts[-1].tensor_proto.string_val[0].decode()
  assert table.startswith("| sample | reward | prompt | completion |")
  assert len(table.splitlines()) == 2 + 4  # header, rule, metrics.num_text_samples rows


def test_wandb_offline_writes_a_run_directory(main_run):
  out, _ = main_run
  run_dir = pathlib.Path(json.loads((out / "summary.json").read_text())["wandb_dir"])
  assert run_dir.parent == out / "wandb" and run_dir.name.startswith("offline-run-")
  (data,) = run_dir.glob("run-*.wandb")
  assert data.stat().st_size > 0


def _assert_real_image(path: pathlib.Path) -> None:
  from PIL import Image  # pylint: disable=g-import-not-at-top

  with Image.open(path) as img:
    img.verify()  # a complete, uncorrupted PNG
  with Image.open(path) as img:
    assert img.format == "PNG" and img.width >= 800 and img.height >= 400
    px = np.asarray(img.convert("L"), np.float32)
  # Not blank: axes, curves and bars cover a real share of the canvas.
  assert (px < 200).mean() > 0.02 and px.std() > 10


def test_report_command_renders_a_png_and_html(main_run, tmp_path):
  out, _ = main_run
  _assert_real_image(out / "report.png")  # written by the main job itself
  png = tmp_path / "compare.png"
  proc = subprocess.run(
      [sys.executable, "-m", "jax_dora.report", str(out), str(out), "-o", str(png)],
      cwd=ROOT, capture_output=True, text=True, check=False, timeout=120)
  assert proc.returncode == 0, proc.stderr
  _assert_real_image(png)
  page = (tmp_path / "compare.html").read_text()
  assert "data:image/png;base64," in page and "dora_pace" in page
  bad = subprocess.run([sys.executable, "-m", "jax_dora.report", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, check=False, timeout=120)
  assert bad.returncode == 2 and "no metrics.jsonl" in bad.stderr


def test_evaluate_command_scores_a_saved_snapshot(main_run):
  out, _ = main_run
  env = _fresh_env()
  proc = subprocess.run(
      [sys.executable, "-m", "jax_dora.evaluate", f"--run_dir={out}", "--num_prompts=4",
       "--num_samples=3", "--greedy"],
      cwd=ROOT, env=env, capture_output=True, text=True, check=False, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  res = json.loads((out / f"eval_step{STEPS}.json").read_text())
  assert res["step"] == STEPS and res["greedy"] and res["num_samples"] == 3
  # Greedy decoding repeats itself: a prompt's three completions are one text, so
  # any-of-3 and the majority are each sample's verdict.
  by_prompt: dict[int, set[str]] = {}
  for s in res["samples"]:
    by_prompt.setdefault(s["sample_id"], set()).add(s["completion"])
  assert len(by_prompt) == 4 and all(len(texts) == 1 for texts in by_prompt.values()), by_prompt
  assert res["eval/pass@3"] == res["eval/pass@1"] == res["eval/maj@3"]
  assert 0.0 <= res["eval/reward"] <= 1.0 and res["eval/reward_stderr"] is not None
  missing = subprocess.run(
      [sys.executable, "-m", "jax_dora.evaluate", f"--run_dir={out}", "--step=999"],
      cwd=ROOT, env=env, capture_output=True, text=True, check=False, timeout=300)
  assert missing.returncode == 2 and "[999] not in" in missing.stderr
  # Several versions with one set of servers: the newest scores what --step scored
  # (greedy, same prompts). Background publishing may skip versions: take two kept ones.
  kept = sorted(int(d.name) for d in (out / "snapshots").iterdir() if d.name.isdigit())
  older = kept[-2]
  several = subprocess.run(
      [sys.executable, "-m", "jax_dora.evaluate", f"--run_dir={out}", "--num_prompts=4",
       "--num_samples=3", "--greedy", f"--steps={older},{STEPS}"],
      cwd=ROOT, env=env, capture_output=True, text=True, check=False, timeout=300)
  assert several.returncode == 0, several.stderr[-3000:]
  rows = json.loads((out / "eval_steps.json").read_text())
  assert [r["step"] for r in rows] == [older, STEPS] and kept[-1] == STEPS
  assert rows[1]["eval/reward"] == res["eval/reward"]
  both = subprocess.run(
      [sys.executable, "-m", "jax_dora.evaluate", f"--run_dir={out}", "--step=1", "--steps=1,2"],
      cwd=ROOT, env=env, capture_output=True, text=True, check=False, timeout=300)
  assert both.returncode == 2 and "not both" in both.stderr
