#!/usr/bin/env bash
# Copies jax-dora to every worker of a TPU slice and pip-installs it there.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<'USAGE'
Usage: install.sh --name NAME --zone ZONE [options]

Packs the repository with `git archive` (source tree incl. configs/), copies it
to every worker (`tpu-vm scp --worker=all`), unpacks it into REMOTE_DIR and
pip-installs it together with jax[tpu] (`tpu-vm ssh --worker=all`).

Required:
  --name NAME           TPU node name
  --zone ZONE           zone of the node
Options:
  --project PROJECT     GCP project (default: gcloud's configured project)
  --ref REF             git ref to pack (default HEAD; uncommitted changes are NOT shipped)
  --package FILE        also copy this built wheel/sdist and pip-install it instead of the tree
  --remote-dir DIR      install dir relative to the remote home (default jax-dora)
  --python BIN          remote python (default python3; jax-dora needs >= 3.11)
  --jax-spec SPEC       JAX requirement installed alongside (default 'jax[tpu]')
  --dry-run             print the commands without running them
  -h, --help            show this help
USAGE
}

NAME=""
ZONE=""
PROJECT=""
REF="HEAD"
PACKAGE=""
REMOTE_DIR="jax-dora"
PYTHON="python3"
JAX_SPEC="jax[tpu]"
LIBTPU_INDEX="https://storage.googleapis.com/jax-releases/libtpu_releases.html"

while (($#)); do
  case "$1" in
    --name | --name=*) take_value NAME "$@"; shift "$SHIFT_N" ;;
    --zone | --zone=*) take_value ZONE "$@"; shift "$SHIFT_N" ;;
    --project | --project=*) take_value PROJECT "$@"; shift "$SHIFT_N" ;;
    --ref | --ref=*) take_value REF "$@"; shift "$SHIFT_N" ;;
    --package | --package=*) take_value PACKAGE "$@"; shift "$SHIFT_N" ;;
    --remote-dir | --remote-dir=*) take_value REMOTE_DIR "$@"; shift "$SHIFT_N" ;;
    --python | --python=*) take_value PYTHON "$@"; shift "$SHIFT_N" ;;
    --jax-spec | --jax-spec=*) take_value JAX_SPEC "$@"; shift "$SHIFT_N" ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *) die "unknown argument '$1' (run with --help for usage)" ;;
  esac
done

require NAME --name
require ZONE --zone
[[ "$REMOTE_DIR" != /* && "$REMOTE_DIR" != *..* && -n "$REMOTE_DIR" ]] ||
  die "--remote-dir must be a relative path under the remote home, got '$REMOTE_DIR'"
if [[ -n "$PACKAGE" && "$DRY_RUN" != "1" && ! -f "$PACKAGE" ]]; then
  die "--package file not found: $PACKAGE"
fi
require_cmd "$GCLOUD"
require_cmd git
set_gcloud_scope "$ZONE" "$PROJECT"

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ARCHIVE_NAME="jax-dora-src.tar.gz"
LOCAL_ARCHIVE="${TMPDIR:-/tmp}/${NAME}-${ARCHIVE_NAME}"

log "pack ${REF} of ${REPO_ROOT}"
run git -C "$REPO_ROOT" archive --format=tar.gz --output="$LOCAL_ARCHIVE" "$REF"

log "copy to all workers of ${NAME}"
files=("$LOCAL_ARCHIVE")
if [[ -n "$PACKAGE" ]]; then
  files+=("$PACKAGE")
fi
run "$GCLOUD" compute tpus tpu-vm scp "${files[@]}" "${NAME}:" \
  --worker=all "${GCLOUD_SCOPE[@]}"

if [[ -n "$PACKAGE" ]]; then
  target="./$(basename "$PACKAGE")"
else
  target="./${REMOTE_DIR}"
fi
remote="rm -rf $(remote_quote "$REMOTE_DIR") && mkdir -p $(remote_quote "$REMOTE_DIR")"
remote+=" && tar -xzf ${ARCHIVE_NAME} -C $(remote_quote "$REMOTE_DIR")"
remote+=" && $(remote_quote "$PYTHON") -m pip install --upgrade pip"
remote+=" && $(remote_quote "$PYTHON") -m pip install $(remote_quote "$target" "$JAX_SPEC") -f ${LIBTPU_INDEX}"
remote+=" && $(remote_quote "$PYTHON") -c \"import jax, jax_dora; print(jax.__version__)\""

log "pip install on all workers of ${NAME}"
run "$GCLOUD" compute tpus tpu-vm ssh "$NAME" --worker=all "${GCLOUD_SCOPE[@]}" \
  --command "$remote"
