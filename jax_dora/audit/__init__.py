"""Self-verifying runs (issue 28): checks that re-derive the trained data itself.

The integrity ledger (``jax_dora.orchestrator.integrity``) proves the
bookkeeping: every sample trained once, groups complete, staleness bounded.
These modules check what the bookkeeping cannot see:

* ``snapshots``: published versions against the learner's own parameters
  (servers check every load against the recorded checksums, ``jax_dora.snapshots``);
* ``labels``: each span's behaviour log-probs recomputed under the version it
  claims;
* ``rewards``: rewards re-scored from the stored prompt and completion;
* ``sample``: the share of trained trajectories the last two re-derive, also
  written down so that ``python -m jax_dora.audit RUN_DIR`` can re-run every
  check offline.
"""
