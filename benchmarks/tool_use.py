"""RL with the python tool against RL without it, from the same tool-SFT policy, over seeds.

Issue 37 item 2. ``configs/tiny_math_tools.py`` trains the model of
``configs/tool_sft.py`` (the shipped base fine-tuned on traces that call
``python`` and copy its output) on word problems whose last step multiplies by a
three- or four-digit number (``jax_dora.data.tool_word_problems``). Two arms per
seed, differing only in ``tools.name``:

* ``with_tool``: the real sandboxed tool runs mid-generation; the ``output``
  block is the tool's (context, no gradient);
* ``without_tool`` (``--config.tools.name=``): single-turn; the model writes
  the output block itself, a guess at the product.

Each run trains ``--budget_s`` seconds (the clock starts after compilation) and
keeps every snapshot; afterwards the versions newest at ``0, every_s, ...`` are
evaluated by ``python -m jax_dora.evaluate --steps`` with the run's own setting
(the tool or not): held-out pass@1 at temperature 1 (``--eval_samples`` per
prompt) and greedy at the end. Read off every evaluated completion's text (an
oracle independent of the trainer): the share that writes a ``python`` block
(``called``), and of completions holding an ``output`` block, the share whose
``#### N`` is that block's number (``copied``): with the tool, "answers that
use the tool result correctly"; without it, answers that copy their own guess.

Usage::

  python -m jax_dora.data.tool_word_problems && python -m jax_dora.sft --config=configs/tool_sft.py
  python benchmarks/tool_use.py --seeds 3 --budget_s 300 --every_s 100 --out runs/tool_use
  python benchmarks/tool_use.py --from_json runs/tool_use/tool_use.json   # the table again
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import re
import shutil
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import rl_from_base  # noqa: E402  pylint: disable=wrong-import-position

from jax_dora.metrics import reward_curves as rc  # noqa: E402  pylint: disable=wrong-import-position
from jax_dora.metrics.jsonl import read_jsonl  # noqa: E402  pylint: disable=wrong-import-position
from jax_dora.report import headline  # noqa: E402  pylint: disable=wrong-import-position

CONFIG = "configs/tiny_math_tools.py"
ARMS = {"with_tool": [], "without_tool": ["--config.tools.name="]}

_OUTPUT_BLOCK = re.compile(r"```output\n(.*?)\n```", re.DOTALL)
_ANSWER = re.compile(r"^#### (\S+)\s*$", re.MULTILINE)


def tool_use(completions: list[str]) -> dict[str, float | None]:
  """``called``: share of completions with a ``python`` block; ``copied``: of those with an
  ``output`` block, the share whose last ``#### N`` is the last block's (stripped) text."""
  called = sum("```python\n" in text for text in completions)
  with_output = copied = 0
  for text in completions:
    outputs = _OUTPUT_BLOCK.findall(text)
    if not outputs:
      continue
    with_output += 1
    answers = _ANSWER.findall(text)
    copied += bool(answers) and answers[-1] == outputs[-1].strip()
  return {"called": called / len(completions) if completions else None,
          "copied": copied / with_output if with_output else None}


def curve(run_dir: pathlib.Path, budget_s: float, every_s: float, num_prompts: int,
          samples: int) -> list[dict]:
  """Pass@1 and tool use at each scheduled point; greedy pass@1 at the last."""
  points = rc.scheduled_versions(read_jsonl(run_dir / "metrics.jsonl"), budget_s, every_s)
  versions = sorted({v for _, v in points})
  sampled = rl_from_base.evaluate(run_dir, versions, num_prompts, samples, greedy=False)
  greedy = rl_from_base.evaluate(run_dir, [points[-1][1]], num_prompts, 1, greedy=True)
  out = []
  for t, v in points:
    use = tool_use([o["completion"] for o in sampled[v]["samples"]])
    out.append({"t": t, "version": v, "pass@1": sampled[v]["eval/pass@1"],
                f"pass@{samples}": sampled[v].get(f"eval/pass@{samples}"), **use,
                **({"greedy_pass@1": greedy[v]["eval/pass@1"]} if v in greedy else {})})
  return out


def _ms(values: list[float | None]) -> str:
  vals = np.array([v for v in values if v is not None], dtype=float)
  if not len(vals):
    return "n/a"
  return f"{vals.mean():.3f} ± {vals.std(ddof=1) / np.sqrt(len(vals)) if len(vals) > 1 else 0:.3f}"


def table(result: dict) -> None:
  print(f"\n{'arm':<14}{'pass@1 at 0':>16}{'pass@1 at end':>16}{'greedy at end':>16}"
        f"{'calls python':>16}{'copies output':>16}{'steps':>7}   (mean ± se over seeds)")
  by_arm: dict[str, list[dict]] = {}
  for r in result["runs"]:
    by_arm.setdefault(r["arm"], []).append(r)
  for arm, runs in by_arm.items():
    first = [r["curve"][0] for r in runs]
    last = [r["curve"][-1] for r in runs]
    print(f"{arm:<14}{_ms([p['pass@1'] for p in first]):>16}{_ms([p['pass@1'] for p in last]):>16}"
          f"{_ms([p.get('greedy_pass@1') for p in last]):>16}{_ms([p['called'] for p in last]):>16}"
          f"{_ms([p['copied'] for p in last]):>16}{np.mean([r['steps'] for r in runs]):>7.0f}")
  if set(by_arm) >= {"with_tool", "without_tool"}:
    gaps = [w["curve"][-1]["pass@1"] - o["curve"][-1]["pass@1"]
            for w, o in zip(sorted(by_arm["with_tool"], key=lambda r: r["seed"]),
                            sorted(by_arm["without_tool"], key=lambda r: r["seed"]))]
    spread = max(np.std([r["curve"][-1]["pass@1"] for r in runs], ddof=1) if len(runs) > 1
                 else float("nan") for runs in by_arm.values())
    print(f"\nwith - without at the end, per seed: {', '.join(f'{g:+.3f}' for g in gaps)};"
          f" largest across-seed std of an arm: {spread:.3f}")


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--seeds", type=int, default=3)
  ap.add_argument("--budget_s", type=float, default=300.0, help="training wall clock per run")
  ap.add_argument("--every_s", type=float, default=100.0, help="evaluation schedule")
  ap.add_argument("--eval_prompts", type=int, default=200)
  ap.add_argument("--eval_samples", type=int, default=4)
  ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {sorted(ARMS)}")
  ap.add_argument("--out", default="runs/tool_use")
  ap.add_argument("--from_json", default="", help="print a finished result again")
  ap.add_argument("overrides", nargs="*", help="--config.x=y for every run")
  a = ap.parse_args()
  if a.from_json:
    table(json.loads(pathlib.Path(a.from_json).read_text()))
    return
  out = pathlib.Path(a.out)
  out.mkdir(parents=True, exist_ok=True)
  runs = []
  for seed in range(a.seeds):
    for arm in a.arms.split(","):
      run_dir = out / f"seed{seed}_{arm}"
      done = run_dir / "result.json"
      if done.exists():  # a rerun of the command resumes
        runs.append(json.loads(done.read_text()))
        continue
      shutil.rmtree(run_dir, ignore_errors=True)
      s = rl_from_base.train(seed, run_dir, a.budget_s, [*ARMS[arm], *a.overrides],
                             cold_cache=False, config=CONFIG)
      c = curve(run_dir, a.budget_s, a.every_s, a.eval_prompts, a.eval_samples)
      shutil.rmtree(run_dir / "snapshots", ignore_errors=True)
      records = read_jsonl(run_dir / "metrics.jsonl")
      result = {"seed": seed, "arm": arm, "curve": c, "steps": s["steps"],
                "trained_tokens_per_s": s["trained_tokens_per_s"],
                "bubble_ratio": headline(records, s).get("bubble"),
                "integrity_violations": len(s.get("integrity_violations") or [])}
      done.write_text(json.dumps(result, indent=1))
      runs.append(result)
      print(f"seed {seed} {arm}: pass@1 {c[0]['pass@1']:.3f} -> {c[-1]['pass@1']:.3f},"
            f" copies output {c[-1]['copied']}", flush=True)
  result = {"date": datetime.datetime.now().isoformat(timespec="minutes"), "config": CONFIG,
            "budget_s": a.budget_s, "every_s": a.every_s, "eval_prompts": a.eval_prompts,
            "eval_samples": a.eval_samples, "overrides": a.overrides, "runs": runs}
  (out / "tool_use.json").write_text(json.dumps(result, indent=1))
  table(result)


if __name__ == "__main__":
  main()
