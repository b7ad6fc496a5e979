"""The long-tail benchmark workload with a mixture-of-experts policy (issue 26).

``configs/long_tail.py`` with every layer's MLP replaced by 8 experts of width
64, top-2: 128 active hidden units per token (half the dense model's 256),
twice its FFN parameters; load-balancing loss at 0.01. Lengths are fixed by the workload (``rollout.length_mode=answer``), so
the rollout-length tail is the dense workload's by construction; what MoE
changes is the per-token cost of rollout and training (on CPU the experts run
as all-experts einsums, ``model.moe_impl=auto``: DESIGN.md, "Mixture of experts")
and the expert load (``train/moe/expert_load_max``).

Usage: python benchmarks/modes.py --workload moe
"""

import importlib.util
import pathlib

_spec = importlib.util.spec_from_file_location(
    "long_tail", pathlib.Path(__file__).with_name("long_tail.py"))
_long_tail = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_long_tail)


def get_config():
  c = _long_tail.get_config()
  c.output_dir = "runs/long_tail_moe"
  c.model.num_experts = 8
  c.model.num_experts_per_tok = 2
  c.model.moe_d_ff = 64
  c.learner.moe_aux_loss_coef = 0.01
  return c
