#!/usr/bin/env bash
# Creates one TPU VM slice, through a queued resource (default) or directly.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<'USAGE'
Usage: create_tpu.sh --name NAME --zone ZONE --accelerator-type TYPE [options]

Creates a TPU VM slice named NAME.

Required:
  --name NAME               TPU node name (also the queued-resource id)
  --zone ZONE               e.g. us-west4-a
  --accelerator-type TYPE   e.g. v5litepod-16, v4-32, v5p-16, v6e-16
Options:
  --project PROJECT         GCP project (default: gcloud's configured project)
  --runtime-version VER     TPU software version (default chosen from TYPE)
  --queued | --no-queued    use `queued-resources create` (default) or `tpu-vm create`
  --spot                    request Spot capacity
  --wait | --no-wait        wait for a queued resource to become ACTIVE (default: wait)
  --wait-timeout SECONDS    give up waiting after this long (default 3600)
  --dry-run                 print the gcloud commands without running them
  -h, --help                show this help
USAGE
}

NAME=""
ZONE=""
PROJECT=""
ACCELERATOR_TYPE=""
RUNTIME_VERSION=""
QUEUED=1
SPOT=0
WAIT=1
WAIT_TIMEOUT=3600
POLL_SECONDS="${POLL_SECONDS:-30}"

while (($#)); do
  case "$1" in
    --name | --name=*) take_value NAME "$@"; shift "$SHIFT_N" ;;
    --zone | --zone=*) take_value ZONE "$@"; shift "$SHIFT_N" ;;
    --project | --project=*) take_value PROJECT "$@"; shift "$SHIFT_N" ;;
    --accelerator-type | --accelerator-type=*) take_value ACCELERATOR_TYPE "$@"; shift "$SHIFT_N" ;;
    --runtime-version | --runtime-version=*) take_value RUNTIME_VERSION "$@"; shift "$SHIFT_N" ;;
    --wait-timeout | --wait-timeout=*) take_value WAIT_TIMEOUT "$@"; shift "$SHIFT_N" ;;
    --queued) QUEUED=1; shift ;;
    --no-queued) QUEUED=0; shift ;;
    --spot) SPOT=1; shift ;;
    --wait) WAIT=1; shift ;;
    --no-wait) WAIT=0; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *) die "unknown argument '$1' (run with --help for usage)" ;;
  esac
done

require NAME --name
require ZONE --zone
require ACCELERATOR_TYPE --accelerator-type
[[ "$WAIT_TIMEOUT" =~ ^[0-9]+$ ]] || die "--wait-timeout must be a number of seconds, got '$WAIT_TIMEOUT'"

if [[ -z "$RUNTIME_VERSION" ]]; then
  case "$ACCELERATOR_TYPE" in
    v4-*) RUNTIME_VERSION="tpu-ubuntu2204-base" ;;
    v5litepod-* | v5e-*) RUNTIME_VERSION="v2-alpha-tpuv5-lite" ;;
    v5p-*) RUNTIME_VERSION="v2-alpha-tpuv5" ;;
    v6e-*) RUNTIME_VERSION="v2-alpha-tpuv6e" ;;
    *) die "no default --runtime-version for --accelerator-type=${ACCELERATOR_TYPE}; pass one" ;;
  esac
fi

require_cmd "$GCLOUD"
set_gcloud_scope "$ZONE" "$PROJECT"

extra=()
if ((SPOT)); then
  extra+=(--spot)
fi

if ((QUEUED)); then
  run "$GCLOUD" compute tpus queued-resources create "$NAME" \
    --node-id="$NAME" "${GCLOUD_SCOPE[@]}" \
    --accelerator-type="$ACCELERATOR_TYPE" \
    --runtime-version="$RUNTIME_VERSION" ${extra[@]+"${extra[@]}"}
  if ((WAIT)); then
    log "waiting for queued resource ${NAME} to become ACTIVE (timeout ${WAIT_TIMEOUT}s)"
    deadline=$((SECONDS + WAIT_TIMEOUT))
    state=""
    while :; do
      run_capture state "$GCLOUD" compute tpus queued-resources describe "$NAME" \
        "${GCLOUD_SCOPE[@]}" --format='value(state.state)'
      if [[ "$DRY_RUN" == "1" ]]; then
        break
      fi
      case "$state" in
        ACTIVE) break ;;
        FAILED | SUSPENDED) die "queued resource ${NAME} is ${state}" 1 ;;
      esac
      if ((SECONDS >= deadline)); then
        die "queued resource ${NAME} not ACTIVE after ${WAIT_TIMEOUT}s (state: ${state:-unknown})" 1
      fi
      sleep "$POLL_SECONDS"
    done
  fi
else
  run "$GCLOUD" compute tpus tpu-vm create "$NAME" "${GCLOUD_SCOPE[@]}" \
    --accelerator-type="$ACCELERATOR_TYPE" \
    --version="$RUNTIME_VERSION" ${extra[@]+"${extra[@]}"}
fi
