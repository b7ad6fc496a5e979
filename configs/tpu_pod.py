"""TPU pod config: learner and rollout servers on separate slices.

Launched by launchers/launch_run.sh; every worker of the learner slice runs
``python -m jax_dora.train --config=configs/tpu_pod.py --config.role=learner``
and every rollout worker ``python -m jax_dora.rollout.server_main
--config=configs/tpu_pod.py --config.role=rollout``. The snapshot directory
must be a ``gs://`` path both slices can read.
"""

from jax_dora.config import base_config


def get_config():
  c = base_config()
  c.precompile = True
  c.mode = "dora_pace"
  c.role = "learner"
  c.output_dir = "gs://CHANGE-ME/jax-dora/run"
  c.total_steps = 2000
  c.progress_bar = False
  c.distributed.enabled = True
  c.model.update(dict(d_model=1024, n_layers=16, n_heads=16, d_ff=4096, max_seq_len=1024, dtype="bfloat16"))
  c.rollout.update(dict(slots=128, max_prefill_length=256, max_new_tokens=768, max_versions=4))
  # Every chip of the learner slice (all its hosts) trains; one orchestrator
  # runs on the primary host (jax_dora.learner.multihost).
  c.learner.update(dict(group_size=16, groups_per_step=64, learning_rate=1e-5, mesh_fsdp=-1, mesh_data=1,
                        num_devices=-1))
  c.orchestrator.max_staleness = 3
  c.pace.target_pool_groups = 32
  c.pace.max_budget = 16
  c.data.max_answer_len = 512
  return c
