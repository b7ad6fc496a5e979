#!/usr/bin/env bash
# Starts jax-dora rollout servers on every worker of one or more TPU slices.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<'USAGE'
Usage: launch_rollout.sh --name NAME [--name NAME2 ...] --zone ZONE --bucket BUCKET
                         --run-name RUN [options] [-- --config.X=Y ...]

Runs `python -m jax_dora.rollout.server_main --config.role=rollout` under nohup
on every worker of each rollout slice (one independent server per worker),
reading snapshots from gs://BUCKET/RUN/snapshots. Each worker logs to
~/jax-dora-logs/RUN/rollout-<hostname>.log. Then looks up the workers'
internal IPs (`tpu-vm describe`) and prints the server addresses to pass to
launch_learner.sh --rollout-addresses (placeholders in dry-run).

Required:
  --name NAME                 rollout TPU node name (repeatable, one per slice)
  --zone ZONE                 zone of the nodes
  --bucket BUCKET             GCS bucket (name or gs://name)
  --run-name RUN              run name ([a-z0-9-]+)
Options:
  --project PROJECT           GCP project (default: gcloud's configured project)
  --port PORT                 gRPC port of every server (default 9000)
  --config PATH               config file on the workers (default configs/tpu_pod.py)
  --remote-dir DIR            install dir relative to the remote home (default jax-dora)
  --python BIN                remote python (default python3)
  --env KEY=VALUE             environment variable for the program (repeatable)
  --addresses-file FILE       also write the comma-separated addresses to FILE
  --dry-run                   print the commands without running them
  -h, --help                  show this help
Everything after `--` is forwarded to the program (must be --config.* flags).
USAGE
}

NAMES=()
ZONE=""
PROJECT=""
BUCKET=""
RUN_NAME=""
PORT=9000
CONFIG="configs/tpu_pod.py"
REMOTE_DIR="jax-dora"
PYTHON="python3"
ADDRESSES_FILE=""
ENVS=()
OVERRIDES=()
env_kv=""
one_name=""

while (($#)); do
  case "$1" in
    --name | --name=*) take_value one_name "$@"; shift "$SHIFT_N"; NAMES+=("$one_name") ;;
    --zone | --zone=*) take_value ZONE "$@"; shift "$SHIFT_N" ;;
    --project | --project=*) take_value PROJECT "$@"; shift "$SHIFT_N" ;;
    --bucket | --bucket=*) take_value BUCKET "$@"; shift "$SHIFT_N" ;;
    --run-name | --run-name=*) take_value RUN_NAME "$@"; shift "$SHIFT_N" ;;
    --port | --port=*) take_value PORT "$@"; shift "$SHIFT_N" ;;
    --config | --config=*) take_value CONFIG "$@"; shift "$SHIFT_N" ;;
    --remote-dir | --remote-dir=*) take_value REMOTE_DIR "$@"; shift "$SHIFT_N" ;;
    --python | --python=*) take_value PYTHON "$@"; shift "$SHIFT_N" ;;
    --addresses-file | --addresses-file=*) take_value ADDRESSES_FILE "$@"; shift "$SHIFT_N" ;;
    --env | --env=*)
      take_value env_kv "$@"; shift "$SHIFT_N"
      check_env_assignment "$env_kv"; ENVS+=("$env_kv") ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h | --help) usage; exit 0 ;;
    --) shift; OVERRIDES=("$@"); break ;;
    *) die "unknown argument '$1' (run with --help for usage)" ;;
  esac
done

((${#NAMES[@]} > 0)) || die "missing required flag --name (run with --help for usage)"
require ZONE --zone
require BUCKET --bucket
require RUN_NAME --run-name
BUCKET="$(normalize_bucket "$BUCKET")"
check_run_name "$RUN_NAME"
if [[ ! "$PORT" =~ ^[0-9]+$ ]] || ((PORT < 1 || PORT > 65535)); then
  die "--port must be 1-65535, got '$PORT'"
fi
check_overrides ${OVERRIDES[@]+"${OVERRIDES[@]}"}
require_cmd "$GCLOUD"
set_gcloud_scope "$ZONE" "$PROJECT"

RUN_DIR="gs://${BUCKET}/${RUN_NAME}"
build_launch_command "$REMOTE_DIR" "jax-dora-logs/${RUN_NAME}/rollout" \
  "${#ENVS[@]}" ${ENVS[@]+"${ENVS[@]}"} \
  "$PYTHON" -m jax_dora.rollout.server_main \
  "--config=${CONFIG}" \
  --config.role=rollout \
  "--config.rollout.port=${PORT}" \
  "--config.snapshots.directory=${RUN_DIR}/snapshots" \
  ${OVERRIDES[@]+"${OVERRIDES[@]}"}

for name in "${NAMES[@]}"; do
  log "start rollout servers on all workers of ${name} (snapshots ${RUN_DIR}/snapshots)"
  run "$GCLOUD" compute tpus tpu-vm ssh "$name" --worker=all "${GCLOUD_SCOPE[@]}" \
    --command "$REMOTE_CMD"
done

addresses=()
ips=""
for name in "${NAMES[@]}"; do
  log "look up worker IPs of ${name}"
  run_capture ips "$GCLOUD" compute tpus tpu-vm describe "$name" "${GCLOUD_SCOPE[@]}" \
    --format='value(networkEndpoints[].ipAddress)'
  if [[ "$DRY_RUN" == "1" ]]; then
    ips="dryrun-${name}-worker-ip"
  fi
  # gcloud joins list values with ';' (some versions use ',' or newlines).
  ips="${ips//$'\n'/ }"
  read -r -a ip_list <<<"${ips//[;,]/ }"
  ((${#ip_list[@]} > 0)) || die "no network endpoints found for TPU ${name}" 1
  for ip in "${ip_list[@]}"; do
    addresses+=("${ip}:${PORT}")
  done
done

joined="$(IFS=,; echo "${addresses[*]}")"
if [[ -n "$ADDRESSES_FILE" ]]; then
  printf '%s\n' "$joined" >"$ADDRESSES_FILE"
fi
log "pass to launch_learner.sh: --rollout-addresses=${joined}"
echo "ROLLOUT_SERVER_ADDRESSES=${joined}"
