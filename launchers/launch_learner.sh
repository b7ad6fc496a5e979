#!/usr/bin/env bash
# Starts the jax-dora learner on every worker of a TPU slice.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<'USAGE'
Usage: launch_learner.sh --name NAME --zone ZONE --bucket BUCKET --run-name RUN
                         --rollout-addresses HOST:PORT,... [options] [-- --config.X=Y ...]

Runs `python -m jax_dora.train --config.role=learner` under nohup on every
worker of the learner slice (multi-host: jax.distributed is initialised by the
program, coordinator/process ids are auto-detected on TPU VMs). Worker 0 runs
the one orchestrator (prompts, rollouts, batches, publishes); the other
workers mirror its train steps on the same global batch over all the slice's
chips (jax_dora/learner/multihost.py). Outputs go to
gs://BUCKET/RUN, snapshots to gs://BUCKET/RUN/snapshots. Each worker logs to
~/jax-dora-logs/RUN/learner-<hostname>.log.

Required:
  --name NAME                 learner TPU node name
  --zone ZONE                 zone of the node
  --bucket BUCKET             GCS bucket (name or gs://name)
  --run-name RUN              run name ([a-z0-9-]+)
  --rollout-addresses ADDRS   comma-separated host:port list (printed by launch_rollout.sh)
Options:
  --project PROJECT           GCP project (default: gcloud's configured project)
  --config PATH               config file on the workers (default configs/tpu_pod.py)
  --remote-dir DIR            install dir relative to the remote home (default jax-dora)
  --python BIN                remote python (default python3)
  --env KEY=VALUE             environment variable for the program (repeatable)
  --dry-run                   print the commands without running them
  -h, --help                  show this help
Everything after `--` is forwarded to the program (must be --config.* flags).
USAGE
}

NAME=""
ZONE=""
PROJECT=""
BUCKET=""
RUN_NAME=""
ROLLOUT_ADDRESSES=""
CONFIG="configs/tpu_pod.py"
REMOTE_DIR="jax-dora"
PYTHON="python3"
ENVS=()
OVERRIDES=()
env_kv=""

while (($#)); do
  case "$1" in
    --name | --name=*) take_value NAME "$@"; shift "$SHIFT_N" ;;
    --zone | --zone=*) take_value ZONE "$@"; shift "$SHIFT_N" ;;
    --project | --project=*) take_value PROJECT "$@"; shift "$SHIFT_N" ;;
    --bucket | --bucket=*) take_value BUCKET "$@"; shift "$SHIFT_N" ;;
    --run-name | --run-name=*) take_value RUN_NAME "$@"; shift "$SHIFT_N" ;;
    --rollout-addresses | --rollout-addresses=*) take_value ROLLOUT_ADDRESSES "$@"; shift "$SHIFT_N" ;;
    --config | --config=*) take_value CONFIG "$@"; shift "$SHIFT_N" ;;
    --remote-dir | --remote-dir=*) take_value REMOTE_DIR "$@"; shift "$SHIFT_N" ;;
    --python | --python=*) take_value PYTHON "$@"; shift "$SHIFT_N" ;;
    --env | --env=*)
      take_value env_kv "$@"; shift "$SHIFT_N"
      check_env_assignment "$env_kv"; ENVS+=("$env_kv") ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h | --help) usage; exit 0 ;;
    --) shift; OVERRIDES=("$@"); break ;;
    *) die "unknown argument '$1' (run with --help for usage)" ;;
  esac
done

require NAME --name
require ZONE --zone
require BUCKET --bucket
require RUN_NAME --run-name
require ROLLOUT_ADDRESSES --rollout-addresses
BUCKET="$(normalize_bucket "$BUCKET")"
check_run_name "$RUN_NAME"
check_overrides ${OVERRIDES[@]+"${OVERRIDES[@]}"}
require_cmd "$GCLOUD"
set_gcloud_scope "$ZONE" "$PROJECT"

RUN_DIR="gs://${BUCKET}/${RUN_NAME}"
build_launch_command "$REMOTE_DIR" "jax-dora-logs/${RUN_NAME}/learner" \
  "${#ENVS[@]}" ${ENVS[@]+"${ENVS[@]}"} \
  "$PYTHON" -m jax_dora.train \
  "--config=${CONFIG}" \
  --config.role=learner \
  --config.distributed.enabled=True \
  "--config.output_dir=${RUN_DIR}" \
  "--config.snapshots.directory=${RUN_DIR}/snapshots" \
  "--config.rollout.server_addresses=${ROLLOUT_ADDRESSES}" \
  ${OVERRIDES[@]+"${OVERRIDES[@]}"}

log "start learner on all workers of ${NAME} (run ${RUN_DIR})"
run "$GCLOUD" compute tpus tpu-vm ssh "$NAME" --worker=all "${GCLOUD_SCOPE[@]}" \
  --command "$REMOTE_CMD"
log "follow logs: ${GCLOUD} compute tpus tpu-vm ssh ${NAME} --worker=0 ${GCLOUD_SCOPE[*]} --command 'tail -f jax-dora-logs/${RUN_NAME}/learner-*.log'"
