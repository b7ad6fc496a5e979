#!/usr/bin/env bash
# Shared helpers for the jax-dora TPU launchers. Source it, do not run it.
#
# Conventions:
#   * every state-changing command goes through `run`, which prints it as
#     `+ cmd args...` (copy-pasteable quoting) and executes it unless
#     DRY_RUN=1;
#   * usage errors exit 2 with an `error: ...` line on stderr;
#   * GCLOUD overrides the gcloud binary (tests put a fake one on PATH).

if [[ -n "${_JAX_DORA_COMMON_SH:-}" ]]; then
  return 0
fi
_JAX_DORA_COMMON_SH=1

DRY_RUN="${DRY_RUN:-0}"
GCLOUD="${GCLOUD:-gcloud}"
# Number of positional arguments the last take_value consumed.
SHIFT_N=1

# Prints an error and exits with status 2 (usage) or $2.
die() {
  echo "error: $1" >&2
  exit "${2:-2}"
}

warn() {
  echo "warning: $*" >&2
}

# Prints a comment line (a step header); always shown, even in dry-run.
log() {
  echo "# $*"
}

# Quotes one word for display so the printed line can be pasted into bash.
quote_word() {
  local w="$1"
  if [[ "$w" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then
    printf '%s' "$w"
  elif [[ "$w" != *[\$\`\"\\!]* ]]; then
    printf '"%s"' "$w"
  else
    printf "'%s'" "${w//\'/\'\\\'\'}"
  fi
}

# Prints `+ cmd args...` on stdout.
print_cmd() {
  local out="+" w
  for w in "$@"; do
    out+=" $(quote_word "$w")"
  done
  printf '%s\n' "$out"
}

# Prints the command and runs it unless DRY_RUN=1.
run() {
  print_cmd "$@"
  if [[ "$DRY_RUN" == "1" ]]; then
    return 0
  fi
  "$@"
}

# run_capture VAR cmd...: like run, but stores the command's stdout in VAR
# (empty in dry-run).
run_capture() {
  local __var="$1"
  shift
  print_cmd "$@"
  local __out=""
  if [[ "$DRY_RUN" != "1" ]]; then
    __out="$("$@")"
  fi
  printf -v "$__var" '%s' "$__out"
}

# take_value VAR "$@": reads the value of the flag in $1, given either as
# `--flag=value` or `--flag value`, into VAR and sets SHIFT_N to the number of
# arguments to shift.
# shellcheck disable=SC2034  # SHIFT_N is read by the sourcing script.
take_value() {
  local __var="$1" __flag="$2"
  shift 2
  if [[ "$__flag" == *=* ]]; then
    printf -v "$__var" '%s' "${__flag#*=}"
    SHIFT_N=1
    return 0
  fi
  if (($# == 0)) || [[ "$1" == --* ]]; then
    die "flag ${__flag} needs a value"
  fi
  printf -v "$__var" '%s' "$1"
  SHIFT_N=2
}

# require VAR --flag: exits with a clear message if VAR is empty.
require() {
  local __var="$1" __flag="$2"
  if [[ -z "${!__var:-}" ]]; then
    die "missing required flag ${__flag} (run with --help for usage)"
  fi
}

# require_cmd BIN: exits if BIN is not on PATH (skipped in dry-run).
require_cmd() {
  if [[ "$DRY_RUN" != "1" ]] && ! command -v "$1" >/dev/null 2>&1; then
    die "'$1' not found on PATH" 1
  fi
}

# Normalises a bucket given as `name`, `gs://name` or `gs://name/`.
normalize_bucket() {
  local b="${1#gs://}"
  b="${b%/}"
  if [[ -z "$b" || "$b" == */* || ! "$b" =~ ^[a-z0-9][a-z0-9._-]*$ ]]; then
    die "--bucket must be a GCS bucket name (e.g. my-bucket or gs://my-bucket), got '$1'"
  fi
  printf '%s' "$b"
}

# Checks a run name is safe in paths and resource names.
check_run_name() {
  if [[ ! "$1" =~ ^[a-z0-9][a-z0-9-]*$ ]]; then
    die "--run-name must match [a-z0-9][a-z0-9-]* (used in TPU and GCS names), got '$1'"
  fi
}

# Shell-quotes every argument for a remote bash command line.
remote_quote() {
  local out="" w
  for w in "$@"; do
    out+=" $(quote_word "$w")"
  done
  printf '%s' "${out# }"
}

# Fills the global GCLOUD_SCOPE array with --zone/--project flags.
set_gcloud_scope() {
  local zone="$1" project="$2"
  GCLOUD_SCOPE=("--zone=${zone}")
  if [[ -n "$project" ]]; then
    GCLOUD_SCOPE+=("--project=${project}")
  fi
}

# check_overrides ARGS...: every argument after `--` must be a --config.* flag.
check_overrides() {
  local o
  for o in "$@"; do
    if [[ "$o" != --config.* ]]; then
      die "arguments after -- must be --config.* overrides, got '$o'"
    fi
  done
}

# check_env_assignment KEY=VALUE: validates an --env argument.
check_env_assignment() {
  if [[ ! "$1" =~ ^[A-Za-z_][A-Za-z0-9_]*= ]]; then
    die "--env needs KEY=VALUE, got '$1'"
  fi
}

# build_launch_command REMOTE_DIR LOG_FILE_STEM ENV_COUNT ENV... CMD...
#
# Sets REMOTE_CMD to a remote bash line that, on a worker, starts CMD (with
# the ENV assignments) in REMOTE_DIR under nohup, detached from the ssh
# session, logging to $HOME/LOG_FILE_STEM-<hostname>.log. Paths are relative
# to the remote home.
build_launch_command() {
  local remote_dir="$1" stem="$2" n_env="$3"
  shift 3
  local envs=("${@:1:n_env}")
  shift "$n_env"
  local log_dir log
  log_dir="$(dirname "$stem")"
  log="\"\$HOME/${stem}-\$(hostname).log\""
  local prog
  prog="$(remote_quote "$@")"
  if ((n_env > 0)); then
    prog="env $(remote_quote "${envs[@]}") ${prog}"
  fi
  REMOTE_CMD="mkdir -p \"\$HOME/${log_dir}\" && cd \"\$HOME/${remote_dir}\""
  REMOTE_CMD+=" && nohup ${prog} > ${log} 2>&1 < /dev/null &"
  REMOTE_CMD+=" echo \"started on \$(hostname), log: ${stem}-\$(hostname).log\""
}
