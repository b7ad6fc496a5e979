#!/usr/bin/env bash
# End to end: create the learner and rollout slices, install jax-dora on both,
# start the rollout servers, then the learner.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

usage() {
  cat <<'USAGE'
Usage: launch_run.sh --run-name RUN --bucket BUCKET --zone ZONE [options] [-- --config.X=Y ...]

Steps (in this order): 1. create the learner slice RUN-learner and the rollout
slices RUN-rollout-0..N-1; 2. install jax-dora on all of them; 3. start the
rollout servers and collect their addresses; 4. start the learner pointed at
them. Snapshots go to gs://BUCKET/RUN/snapshots.

Required:
  --run-name RUN              run name ([a-z0-9-]+), prefix of the TPU names
  --bucket BUCKET             GCS bucket (name or gs://name)
  --zone ZONE                 zone for all slices
Options:
  --project PROJECT           GCP project (default: gcloud's configured project)
  --learner-type TYPE         learner accelerator type (default v5litepod-16)
  --rollout-type TYPE         rollout accelerator type (default v5litepod-16)
  --rollout-slices N          number of rollout slices (default 1)
  --runtime-version VER       TPU software version (default chosen from the type)
  --queued | --no-queued      create through queued resources (default) or directly
  --spot                      request Spot capacity
  --port PORT                 rollout server port (default 9000)
  --config PATH               config file on the workers (default configs/tpu_pod.py)
  --skip-create               reuse existing slices
  --skip-install              do not reinstall the package
  --dry-run                   print every command, in order, without running any
  -h, --help                  show this help
Everything after `--` is forwarded to both programs (must be --config.* flags).
USAGE
}

RUN_NAME=""
BUCKET=""
ZONE=""
PROJECT=""
LEARNER_TYPE="v5litepod-16"
ROLLOUT_TYPE="v5litepod-16"
ROLLOUT_SLICES=1
RUNTIME_VERSION=""
QUEUED=1
SPOT=0
PORT=9000
CONFIG="configs/tpu_pod.py"
SKIP_CREATE=0
SKIP_INSTALL=0
OVERRIDES=()

while (($#)); do
  case "$1" in
    --run-name | --run-name=*) take_value RUN_NAME "$@"; shift "$SHIFT_N" ;;
    --bucket | --bucket=*) take_value BUCKET "$@"; shift "$SHIFT_N" ;;
    --zone | --zone=*) take_value ZONE "$@"; shift "$SHIFT_N" ;;
    --project | --project=*) take_value PROJECT "$@"; shift "$SHIFT_N" ;;
    --learner-type | --learner-type=*) take_value LEARNER_TYPE "$@"; shift "$SHIFT_N" ;;
    --rollout-type | --rollout-type=*) take_value ROLLOUT_TYPE "$@"; shift "$SHIFT_N" ;;
    --rollout-slices | --rollout-slices=*) take_value ROLLOUT_SLICES "$@"; shift "$SHIFT_N" ;;
    --runtime-version | --runtime-version=*) take_value RUNTIME_VERSION "$@"; shift "$SHIFT_N" ;;
    --port | --port=*) take_value PORT "$@"; shift "$SHIFT_N" ;;
    --config | --config=*) take_value CONFIG "$@"; shift "$SHIFT_N" ;;
    --queued) QUEUED=1; shift ;;
    --no-queued) QUEUED=0; shift ;;
    --spot) SPOT=1; shift ;;
    --skip-create) SKIP_CREATE=1; shift ;;
    --skip-install) SKIP_INSTALL=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h | --help) usage; exit 0 ;;
    --) shift; OVERRIDES=("$@"); break ;;
    *) die "unknown argument '$1' (run with --help for usage)" ;;
  esac
done

require RUN_NAME --run-name
require BUCKET --bucket
require ZONE --zone
check_run_name "$RUN_NAME"
BUCKET="$(normalize_bucket "$BUCKET")"
[[ "$ROLLOUT_SLICES" =~ ^[1-9][0-9]*$ ]] || die "--rollout-slices must be a positive integer, got '$ROLLOUT_SLICES'"
check_overrides ${OVERRIDES[@]+"${OVERRIDES[@]}"}

# Flags every sub-script shares.
common=(--zone="$ZONE")
if [[ -n "$PROJECT" ]]; then
  common+=(--project="$PROJECT")
fi
if [[ "$DRY_RUN" == "1" ]]; then
  common+=(--dry-run)
fi
create_flags=()
if ((QUEUED)); then
  create_flags+=(--queued)
else
  create_flags+=(--no-queued)
fi
if ((SPOT)); then
  create_flags+=(--spot)
fi
if [[ -n "$RUNTIME_VERSION" ]]; then
  create_flags+=(--runtime-version="$RUNTIME_VERSION")
fi
job=(--bucket="$BUCKET" --run-name="$RUN_NAME" --config="$CONFIG")

LEARNER="${RUN_NAME}-learner"
ROLLOUTS=()
for ((i = 0; i < ROLLOUT_SLICES; i++)); do
  ROLLOUTS+=("${RUN_NAME}-rollout-${i}")
done

if ((SKIP_CREATE)); then
  log "step 1/4: create slices (skipped)"
else
  log "step 1/4: create slices"
  "$HERE/create_tpu.sh" --name="$LEARNER" --accelerator-type="$LEARNER_TYPE" \
    "${common[@]}" "${create_flags[@]}"
  for r in "${ROLLOUTS[@]}"; do
    "$HERE/create_tpu.sh" --name="$r" --accelerator-type="$ROLLOUT_TYPE" \
      "${common[@]}" "${create_flags[@]}"
  done
fi

if ((SKIP_INSTALL)); then
  log "step 2/4: install (skipped)"
else
  log "step 2/4: install jax-dora"
  for node in "$LEARNER" "${ROLLOUTS[@]}"; do
    "$HERE/install.sh" --name="$node" "${common[@]}"
  done
fi

log "step 3/4: start rollout servers"
addresses_file="$(mktemp "${TMPDIR:-/tmp}/${RUN_NAME}-addresses.XXXXXX")"
trap 'rm -f "$addresses_file"' EXIT
rollout_names=()
for r in "${ROLLOUTS[@]}"; do
  rollout_names+=(--name="$r")
done
"$HERE/launch_rollout.sh" "${rollout_names[@]}" "${common[@]}" "${job[@]}" \
  --port="$PORT" --addresses-file="$addresses_file" \
  -- ${OVERRIDES[@]+"${OVERRIDES[@]}"}
addresses="$(<"$addresses_file")"
[[ -n "$addresses" ]] || die "launch_rollout.sh returned no server addresses" 1

log "step 4/4: start learner"
"$HERE/launch_learner.sh" --name="$LEARNER" "${common[@]}" "${job[@]}" \
  --rollout-addresses="$addresses" \
  -- ${OVERRIDES[@]+"${OVERRIDES[@]}"}
log "run ${RUN_NAME} started: outputs in gs://${BUCKET}/${RUN_NAME}"
