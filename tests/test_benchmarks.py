"""The modes benchmark runs end to end (no performance assertions here: the
ratios it prints are the claim, measured side by side in one run)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="split placement needs 2 cores")
def test_modes_benchmark_split_placement_smoke(tmp_path):
  """Learner and a gRPC rollout server on disjoint cores; table printed, data intact (one mode:
  sync's table row and split runs are the same code; the modes' runs are tested in their own
  files)."""
  proc = subprocess.run(
      [sys.executable, "benchmarks/modes.py", "--modes=dora_pace", "--budget_s=6", "--rounds=1",
       f"--out={tmp_path}", "--config.eval.num_prompts=8", "--config.precompile=False"],
      cwd=ROOT, capture_output=True, text=True, timeout=600,
      env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  rows = {m.group(1): m.group(0) for m in re.finditer(r"^(sync|dora_pace)\s+\d+\s.*$", proc.stdout, re.M)}
  assert set(rows) == {"dora_pace"}, proc.stdout
  for row in rows.values():
    assert row.split()[-1] == "0", f"integrity violations: {row}"  # last column
  assert "placement split" in proc.stdout
  summary = json.loads((tmp_path / "round0" / "dora_pace" / "summary.json").read_text())
  assert summary["final_eval_reward_stderr"] >= 0.0  # the eval's noise is reported with it
  # The learner really talked to a separate server process over gRPC.
  log = (tmp_path / "round0" / "dora_pace" / "rollout_server.log").read_text()
  assert "serving on" in log


def test_modes_rounds_ratios_by_hand():
  """Ratios are taken within a round, then summarised: a round where the whole
  machine ran 2x slower leaves the ratio unchanged."""
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import modes  # pylint: disable=g-import-not-at-top

  def run(tok, bubble, ev):
    return {"steps": 10, "trained_tokens_per_s": tok, "steps_per_s": tok / 50,
            "bubble_ratio": bubble, "wasted_share": 0.0,
            "mean_reward_last": 0.0, "reprefill_tokens": 0, "final_eval_reward": ev,
            "integrity_violations": []}

  runs = {"sync": [run(100, 0.6, 0.20), run(50, 0.7, 0.22), run(100, 0.6, 0.24)],
          "dora": [run(200, 0.0, 0.30), run(100, 0.1, 0.32), run(300, 0.0, 0.34)]}
  rows = modes.aggregate_rounds(runs)
  x = rows["dora"]["x_ref"]
  # Per round 2.0, 2.0, 3.0 (the slow second round keeps its 2.0).
  assert (x["median"], x["min"], x["max"], x["n"]) == (2.0, 2.0, 3.0, 3)
  assert x["mean"] == pytest.approx(7 / 3)
  assert rows["dora"]["x_ref_steps"]["median"] == pytest.approx(2.0)
  assert rows["sync"]["bubble"]["median"] == 0.6 and rows["sync"]["bubble"]["max"] == 0.7
  assert rows["dora"]["final_eval_reward"] == pytest.approx(0.32)
  assert rows["dora"]["final_eval_reward_stderr"] == pytest.approx(0.02 / 3 ** 0.5)
  order = [modes.round_order(["a", "b", "c", "d"], r, 0) for r in range(4)]
  assert all(sorted(o) == ["a", "b", "c", "d"] for o in order) and len(set(map(tuple, order))) > 1
  assert order[1] == modes.round_order(["a", "b", "c", "d"], 1, 0)  # reproducible


def test_modes_reward_drop_by_hand():
  """The collapse flag: the largest fall of the 5-step mean training reward below its best."""
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import modes  # pylint: disable=g-import-not-at-top

  assert modes.reward_drop([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]) == 0.0  # only rising
  # Window means 1.0, then (1+1+1+1+0)/5 = 0.8, then 0.6: 0.4 below the best.
  assert modes.reward_drop([1, 1, 1, 1, 1, 0, 0]) == pytest.approx(0.4)
  # A collapse after the best, then a partial recovery: the deepest point counts.
  assert modes.reward_drop([0] * 5 + [1] * 10 + [0] * 5 + [0.5] * 5) == pytest.approx(1.0)
  assert modes.reward_drop([1, 1]) == 0.0  # shorter than a window


def test_modes_dora_pace_against_async_unfiltered_of_the_same_variant():
  """Per-round ratios by hand: under variants each dora_pace run is divided by async_unfiltered's
  run of the same variant and round; turns/s only where every run has it (tool workloads)."""
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import modes  # pylint: disable=g-import-not-at-top

  def run(tok, steps, turns=None):
    return {"trained_tokens_per_s": tok, "steps_per_s": steps,
            **({"turns_per_s": turns} if turns is not None else {})}

  runs = {"async_unfiltered@a": [run(100, 2.0, 4.0), run(100, 2.0, 4.0)],
          "async_unfiltered@b": [run(50, 1.0, 2.0), run(200, 4.0, 8.0)],
          "dora_pace@a": [run(110, 1.0, 3.0), run(90, 3.0, 5.0)],
          "dora_pace@b": [run(100, 1.0, 1.0), run(100, 4.0, 4.0)]}
  rows = {m: {} for m in runs}
  lines = modes.versus_async_unfiltered(runs, rows)
  assert rows["dora_pace@a"]["x_async_unfiltered"]["min"] == pytest.approx(0.9)
  assert rows["dora_pace@a"]["x_async_unfiltered"]["max"] == pytest.approx(1.1)
  assert rows["dora_pace@a"]["x_async_unfiltered_steps"]["median"] == pytest.approx(1.0)  # 0.5, 1.5
  assert rows["dora_pace@b"]["x_async_unfiltered"]["median"] == pytest.approx(1.25)  # 2.0, 0.5
  assert rows["dora_pace@b"]["x_async_unfiltered_turns"]["median"] == pytest.approx(0.5)
  assert len(lines) == 6 and lines[0].startswith("dora_pace@a / async_unfiltered@a")
  # One async_unfiltered run for every variant of dora_pace (--variant_modes dora_pace), no turns.
  runs = {"async_unfiltered": [run(100, 2.0)], "dora_pace@a": [run(150, 3.0)]}
  rows = {m: {} for m in runs}
  assert len(modes.versus_async_unfiltered(runs, rows)) == 2
  assert rows["dora_pace@a"]["x_async_unfiltered_steps"]["median"] == pytest.approx(1.5)


def test_modes_benchmark_rejects_unknown_flags():
  proc = subprocess.run([sys.executable, "benchmarks/modes.py", "--bogus=1"], cwd=ROOT,
                        capture_output=True, text=True, timeout=60)
  assert proc.returncode != 0 and "config overrides look like --config.x=y" in proc.stderr


def test_learner_memory_benchmark_chunked_below_naive():
  """Small sizes (the full benchmark is V=151,936, T=2,048): the chunked step's
  temporaries are below the naive step's and close to the two-term prediction."""
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import learner_memory  # pylint: disable=g-import-not-at-top

  res = learner_memory.main(["--vocab=20000", "--seq_len=513", "--rows=2", "--chunk=64",
                             "--d_model=64"])
  names = [n for n in res if n != "model"]
  naive, chunked, micro = (res[n]["temp"] for n in names[:3])
  assert chunked < naive / 2 and micro <= chunked
  predicted = res["model"]["predicted_chunked_temp"]
  assert abs(chunked - predicted) / predicted < 0.35, res
  # The MoE case on XLA:CPU: more than a native grouped matmul would add, within the
  # per-expert expansion's bound (measured 0.063 GiB vs 0.004 native, 0.078 expanded).
  moe = res["moe"]
  extra = moe["moe_temp"] - moe["dense_temp"]
  assert moe["predicted_native"] < extra <= 1.3 * moe["predicted_cpu_expansion"], moe


@pytest.mark.slow
def test_learner_memory_estimate_holds_for_gemma():
  """Gemma 2's block (soft-caps, sandwich norms, local layers): the chunked step's temporaries
  are below the naive step's and close to the same two-term prediction (20 s: slow)."""
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import learner_memory  # pylint: disable=g-import-not-at-top

  res = learner_memory.main(["--vocab=20000", "--seq_len=513", "--rows=2", "--chunk=64",
                             "--d_model=64", "--gemma", "--experts=0"])
  names = [n for n in res if n != "model"]
  naive, chunked = (res[n]["temp"] for n in names[:2])
  assert chunked < naive / 2
  predicted = res["model"]["predicted_chunked_temp"]
  assert abs(chunked - predicted) / predicted < 0.35, res


def test_staleness_sweep_reads_realised_staleness_and_mismatch(tmp_path):
  """The sweep's per-run numbers from a metrics log written out by hand (the
  full sweep is an hour; its runs are benchmarks/modes.py runs, smoke-tested above)."""
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import staleness_sweep  # pylint: disable=g-import-not-at-top

  recs = [
      {"staleness_behaviour": {"mean": 0.0, "max": 0, "n": 4}, "train/stale_token_frac": 0.0,
       "train/mismatch/kl_k3_stale0": 0.0, "train/mismatch/kl_k3_stale_gt0": 0.0,
       "train/is_weight_max": 1.0},
      {"staleness_behaviour": {"mean": 3.0, "max": 5, "n": 4}, "train/stale_token_frac": 0.5,
       "train/mismatch/kl_k3_stale0": 0.0, "train/mismatch/kl_k3_stale_gt0": 0.02,
       "train/is_weight_max": 2.5},
  ]
  (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
  m = staleness_sweep.run_metrics(tmp_path)
  # Mean of step means; KL of stale tokens only over steps that had any.
  assert m == {"staleness_mean": 1.5, "staleness_max": 5, "kl_stale0": 0.0,
               "kl_stale_gt0": 0.02, "is_weight_max": 2.5}
  with pytest.raises(SystemExit):
    staleness_sweep.main(["--losses=ppo2"])


def test_accelerator_benchmark_small(tmp_path):
  """``benchmarks/accelerator.py --small`` end to end on CPU: every section's
  figures, each below its floor (noise allowed) and positive; and the floor
  arithmetic on shapes worked out by hand."""
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import accelerator  # pylint: disable=g-import-not-at-top

  # A made-up shape: d=8, 2 layers, 2 query / 1 KV heads of 4, d_ff 16, vocab 100, tied.
  s = accelerator.Shape(vocab_size=100, d_model=8, n_layers=2, n_heads=2, n_kv_heads=1,
                        head_dim=4, d_ff=16, tie_embeddings=True)
  # q 8*8 + k,v 2*8*4 + o 8*8 + MLP 3*8*16 = 576 per layer; N = 2*576 + head 8*100.
  assert accelerator.layer_matmul_params(s) == 576
  assert accelerator.matmul_params(s) == 1952
  # + q/k/v biases (2+1+1)*4 and two norms of 8 per layer, embedding 800, final norm 8.
  assert accelerator.param_count(s) == 800 + 2 * (576 + 16 + 16) + 8 == 2024
  from jax_dora.model import init_params  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  tree = jax.eval_shape(lambda r: init_params(s.model_config(32, "bfloat16", "bfloat16"), r),
                        jax.random.PRNGKey(0))
  assert sum(x.size for x in jax.tree.leaves(tree)) == 2024  # the count is the model's
  assert accelerator.kv_bytes_per_token(s, 2) == 2 * 2 * 1 * 4 * 2 == 32
  # Two slots at positions 10 and 20: params 2024*2 bytes + (10+20) cached tokens * 32;
  # FLOPs 2*N*2 rows + attention 4*L*H*D = 64 per key over 11 + 21 keys.
  assert accelerator.decode_step_work(s, [10, 20]) == (4048 + 960, 7808 + 64 * 32)
  assert accelerator.decode_step_work(s, [10, 20], versions=2) == (2 * 4048 + 960, 9856)
  # Untied: the 800-entry table is only gathered (2 rows of 8); the head 800 is read.
  untied = dataclasses.replace(s, tie_embeddings=False)
  assert accelerator.param_count(untied) == 2824
  assert accelerator.param_read_bytes(untied, 2, 2) == (2824 - 800 + 16) * 2
  # The roofline: max(5008 B / 1000 B/s, 9856 FLOP / 1e4 FLOP/s) = 5.008 s, summed over steps.
  assert accelerator.floor_seconds([(5008, 9856)], 1000.0, 1e4) == pytest.approx(5.008)
  assert accelerator.floor_seconds([(5008, 9856), (10, 9856)], 1000.0, 1e4) == pytest.approx(
      5.008 + 0.9856)
  # Prefill of prompts of 4 and 6 tokens in one call: params once + 10 KV entries written;
  # blocks 2*2*576*10, head on 2 last positions 2*8*100*2, causal attention 2*L*H*D*T^2.
  assert accelerator.prefill_work(s, [4, 6]) == (4048 + 320, 23040 + 3200 + 32 * (16 + 36))
  # Learner: 6*N*tokens + 6*L*T^2*H*D per row = 6*1952*8 + 6*2*16*2*4*2.
  assert accelerator.learner_step_flops(s, rows=2, seq=4) == 93696 + 3072
  # Qwen2.5-0.5B: 494,032,768 parameters; one step of 256 slots at position 256 moves
  # 988,065,536 + 256*256*12,288 bytes: 0.417 ms at 4.3 TB/s (the 0.42 ms floor).
  q05 = accelerator.SHAPES["0.5b"]
  assert accelerator.param_count(q05) == 494_032_768
  work = accelerator.decode_step_work(q05, [256] * 256)
  assert work[0] == 1_793_371_904
  assert accelerator.floor_seconds([work], 4.3e12, 7e14) * 1e3 == pytest.approx(0.417, abs=1e-3)

  out = tmp_path / "acc.json"
  proc = subprocess.run(
      [sys.executable, "benchmarks/accelerator.py", "--small", f"--json={out}"],
      cwd=ROOT, capture_output=True, text=True, timeout=240,
      env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "of floor" in proc.stdout
  res = json.loads(out.read_text())
  assert res["errors"] == {} and res["peaks"]["copy_bytes_per_s"] > 0
  figs = {f["key"]: f for f in res["figures"]}
  assert {f["section"] for f in res["figures"]} == set(accelerator.SECTIONS)
  st = res["settings"]
  want = ["env.copy_gb_per_s", "env.matmul_tflop_per_s", "import.seconds", "import.peak_rss_mib",
          "import.tensorflow", "learner.build_seconds", "learner.compile_seconds",
          "learner.step_seconds", "learner.tok_per_s"]
  for n in st["slots"]:
    want.append(f"prefill.slots{n}.tok_per_s")
    for k in st["versions"]:
      want += [f"decode.slots{n}.v{k}.ms_per_step", f"decode.slots{n}.v{k}.tok_per_s"]
      if k > 1:
        want.append(f"decode.slots{n}.v{k}.ratio")
  assert not set(want) - set(figs), sorted(set(want) - set(figs))
  assert "hf.skipped" in figs or any(k.startswith("hf.slots") for k in figs)
  for key, f in figs.items():
    if f["fraction"] is not None:
      assert 0 < f["fraction"] < 1.5, (key, f)
      assert f["floor_value"] > 0 and f["floor_s"] > 0, (key, f)
    if f["unit"].endswith("/s") and f["value"] is not None:
      assert f["value"] > 0, (key, f)
  for key in want:
    if key.startswith(("decode.", "prefill.")) and not key.endswith(".ratio"):
      assert figs[key]["fraction"] is not None, key
  assert figs["learner.step_seconds"]["fraction"] is not None  # the MFU


def test_moe_grouped_matmul_benchmark_runs(tmp_path):
  """Smoke run at a tiny shape (the CPU numbers are in DESIGN.md; no timing is asserted)."""
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import moe_grouped_matmul  # pylint: disable=g-import-not-at-top

  out = moe_grouped_matmul.main(["--tokens=64", "--d_model=32", "--d_ff=16", "--experts=4",
                                 "--top_k=2", "--dtype=float32", "--iters=1",
                                 f"--json={tmp_path / 'moe.json'}"])
  assert out["ragged_s"] > 0 and out["floor_s"] > 0 and (tmp_path / "moe.json").exists()


def test_sliding_window_benchmark_small(tmp_path):
  """Smoke run at a tiny shape; the byte counts are checked by hand: 2 slots x (K + V) x 1 KV
  head x 16 dims x 4 B = 256 B an entry; 6 layers x 512 positions allocated; 1 global layer x
  512 + 5 local x 64 read (no timing is asserted)."""
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import sliding_window  # pylint: disable=g-import-not-at-top

  out = sliding_window.main(["--small", f"--json={tmp_path / 'sw.json'}"])
  row = out["contexts"][512]
  assert row["local_bytes"]["allocated"] == row["global_bytes"]["allocated"] == 256 * 6 * 512
  assert row["local_bytes"]["read_per_step"] == 256 * (512 + 5 * 64)
  assert row["global_step_s"] > 0 and row["floor_step_s"] > 0 and (tmp_path / "sw.json").exists()


def test_weight_sync_benchmark_small(tmp_path):
  """Files, memory and JAX's transfer server (its servers are processes of their own that
  pull over loopback), 2 servers, on a tiny model, with the floors measured (no timing is
  asserted: the table is the benchmark's job; each case is a process, so three cases only)."""
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import weight_sync  # pylint: disable=g-import-not-at-top

  out = weight_sync.main(["--small", "--transports=orbax_rollout_dtype,device,transfer_server",
                          "--servers=2",
                          "--no_parts", f"--dir={tmp_path / 'ws'}", f"--json={tmp_path / 'ws.json'}"])
  assert out["memcpy_gib_s"] > 0 and out["disk_write_gib_s"] > 0
  runs = out["shapes"]["tiny"]["runs"]
  assert set(runs) == {"orbax_rollout_dtype/2", "device/2", "transfer_server/2"}
  assert all(r["to_first_decode_s"] > 0 and r["versions_per_s"] > 0 for r in runs.values())
  # Two pulls per version (one per server process), each after its own offer.
  assert 0 < runs["transfer_server/2"]["offer_s"] < runs["transfer_server/2"]["load_all_s"]


def test_pace_records_by_hand(tmp_path):
  """Rejections, lengths and staleness of a hand-written trained-sample log."""
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import pace_records  # pylint: disable=g-import-not-at-top

  def finished(sid, m, n):
    return {"event": "finished", "sample_id": sid, "member": m, "num_tokens": n}

  log = [finished(1, 0, 10), finished(1, 1, 20), finished(2, 0, 3), finished(2, 1, 5),
         {"event": "rejected", "sample_id": 2, "members": [0, 1], "reason": "pace_waiting",
          "regenerate": True},
         *({"event": "trained", "sample_id": 1, "member": m, "num_tokens": n,
            "learner_version": 7, "spans": [[0, n, v]]} for m, n, v in ((0, 10, 5), (1, 20, 6)))]
  (tmp_path / "trained_samples.jsonl").write_text("\n".join(json.dumps(r) for r in log) + "\n")
  r = pace_records.run_records(tmp_path)
  assert r["trained_groups"] == 1 and r["rejected_groups"] == {"pace_waiting": 1}
  assert r["rejected_share"] == 0.5
  assert r["rejected_len_mean"] == 4.0 and r["trained_len_mean"] == 15.0
  assert r["staleness_mean"] == 1.5 and r["staleness_max"] == 2
  assert math.isnan(r["wasted_frac"]) and math.isnan(r["reference_latency"])  # no metrics log
  steps = [{"step": 1, "wasted_rollout_frac": 0.0, "pace": {"pace_calls": 0}},
           {"step": 2, "wasted_rollout_frac": 0.1, "pace": {
               "pace_calls": 3, "pace_reference_latency": 2.0,
               "pace_reference_versions_per_token": 0.01}},
           {"step": 3, "wasted_rollout_frac": 0.2, "pace": {
               "pace_calls": 5, "pace_reference_latency": 4.0,
               "pace_reference_versions_per_token": 0.03}},
           {"summary": True}]
  (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in steps) + "\n")
  r = pace_records.run_records(tmp_path)
  assert r["wasted_frac"] == 0.2  # the last step's running share
  assert r["reference_latency"] == 3.0 and r["reference_rate"] == pytest.approx(0.02)


def test_rl_from_base_table_and_plot_by_hand(tmp_path, capsys):
  """Two seeds' hand-made curves: the table's means/stds and each seed's rise, and the plot file."""
  if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))
  import rl_from_base  # pylint: disable=g-import-not-at-top

  def run(seed, a, b):
    return {"seed": seed, "steps": 10, "startup_s": 60.0, "bubble_ratio": 0.05,
            "integrity_violations": 0,
            "curve": [{"t": 0.0, "pass@1": a, "greedy_pass@1": a + 0.1, "miscopied": 0.4},
                      {"t": 60.0, "pass@1": b, "greedy_pass@1": b + 0.1,
                       "miscopied": 0.1 * (seed + 1)}]}

  result = {"runs": [run(0, 0.2, 0.3), run(1, 0.2, 0.4)], "eval_prompts": 8}
  rl_from_base.table(result)
  rl_from_base.plot(result, str(tmp_path / "curve.png"))
  out = capsys.readouterr().out
  # minute 1: pass@1 mean (0.3 + 0.4) / 2 = 0.35, population std 0.05; rises of 10 and 20 points.
  # miscopied share at minute 1: seeds 0.1 and 0.2, mean 0.15, std 0.05.
  assert "     1.0        0.350 ± 0.050        0.450 ± 0.050        0.150 ± 0.050" in out
  assert "seed 0: pass@1 0.200 -> 0.300 (+10.0 points)" in out
  assert "seed 1: pass@1 0.200 -> 0.400 (+20.0 points)" in out
  assert (tmp_path / "curve.png").stat().st_size > 0


def test_miscopied_share_reads_the_answer_line_against_the_last_worked_line():
  if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))
  import rl_from_base  # pylint: disable=g-import-not-at-top

  completions = [
      "12 + 5 = 17\n#### 17",            # copied right (wrong arithmetic would not matter)
      "12 + 5 = 18\n18 * 2 = 36\n#### 18",  # miscopied: an operand of the last line
      "12 + 5 = 17\n#### 5",             # miscopied
      "#### 17",                          # no worked line: not counted
      "12 + 5 = 17",                      # no answer line: not counted
  ]
  assert rl_from_base.miscopied_share(completions) == 2 / 3
  assert rl_from_base.miscopied_share(["no lines"]) is None


def test_pool_rounds_by_hand(tmp_path, capsys):
  """Rounds of two records pooled on a log scale: 0.5x and 2x rounds average to 1x, not 1.25x;
  the interval is the t-interval of the logs, computed here from the textbook formula."""
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import pool_rounds  # pylint: disable=g-import-not-at-top

  def record(ref_rates, mode_rates):
    return {"date": "d", "overrides": [], "per_round": {
        "a": [{"steps_per_s": r, "final_eval_reward": 1.0} for r in ref_rates],
        "b@x": [{"steps_per_s": r, "final_eval_reward": 0.5} for r in mode_rates]}}

  (tmp_path / "one.json").write_text(json.dumps(record([2.0, 1.0], [1.0, 2.0])))
  (tmp_path / "two.json").write_text(json.dumps(record([1.0, 1.0], [1.0, 1.0])))
  out = pool_rounds.main([f"{tmp_path / 'one.json'}:a:b@x", f"{tmp_path / 'two.json'}:a:b@x"])
  # Ratios 0.5, 2, 1, 1: logs -l, +l, 0, 0 with l = ln 2; mean 0, sample sd = l * sqrt(2/3).
  assert out["rounds"] == 4 and out["geomean"] == pytest.approx(1.0)
  assert out["at_or_above_1"] == 3
  half = 3.182446 * math.log(2) * math.sqrt(2 / 3) / 2  # t(3) 97.5% quantile: 3.1824
  assert out["low"] == pytest.approx(math.exp(-half), rel=1e-5)
  assert out["high"] == pytest.approx(math.exp(half), rel=1e-5)
  printed = capsys.readouterr().out
  assert "0.500, 2.000" in printed and "held-out reward 0.500 vs 1.000" in printed
  with pytest.raises(SystemExit, match="not in this record"):
    pool_rounds.main([f"{tmp_path / 'one.json'}:a:nope"])
