#!/usr/bin/env bash
# The commands of this project, each doing all the set-up it needs on a fresh Debian 12/13
# machine (as root: Slurm comes from Debian's packages):
#
#   ./dev.sh drill [--xid 79] [--node NODE] [--trainer torch] [--corrupt-latest-checkpoint] [--json]
#       a recovery drill on the embedded local stack (Temporal dev server, Slurm, worker); with
#       --trainer torch, of a real distributed PyTorch job (installs PyTorch's CPU build first)
#   ./dev.sh test [pytest arguments]
#       the test suite (starts and stops every service it needs; installs the frameworks whose
#       checkpoints it reads: PyTorch's CPU build, Lightning, Transformers)
#   ./dev.sh check
#       the static checks, no service: ruff format --check, ruff check, mypy (workflows,
#       activities, backends, contracts) and lint-imports (the import layers); each one runs, and
#       the exit status is 1 when any of them found something
#   ./dev.sh test-fast [pytest arguments]
#       the fast tier, no Slurm and no Temporal server: tests/unit and tests/replay, on two
#       pytest-xdist workers (-n 0 runs them in one process)
#
# Set-up: Debian packages (Slurm, munge, curl, python3-venv), then a virtual environment in .venv
# with the project and its pinned dependencies (the test and check extras). `check` needs only
# python3-venv and the virtual environment. Each step is skipped when already done.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

DEB_PACKAGES=(slurmctld slurmd slurm-client slurmrestd munge slurm-wlm-jwt-plugin curl iproute2 python3-venv
             prometheus prometheus-alertmanager chromium)

say() { echo "dev.sh: $*" >&2; }

install_debian_packages() {
  local missing=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" -ne 0 ]; then
    say "missing Debian packages: ${missing[*]}; run as root or install them first"; exit 1
  fi
  say "installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# The project's extras a command needs: the drill's local stack, the tests and the static checks
# always; the tests also the frameworks whose checkpoints they read (PyTorch, Lightning, Trainer),
# and a drill of the PyTorch job PyTorch.
# What one command installed stays for the next; the stamp says which extras of which
# pyproject.toml are installed.
BASE_EXTRAS=drills,test,check

install_python_env() {
  local stamp=.venv/.installed-from sha installed_sha installed wanted missing=()
  sha=$(sha256sum pyproject.toml | cut -d' ' -f1)
  read -r installed_sha installed 2>/dev/null < "$stamp" || true
  [ "${installed_sha:-}" = "$sha" ] || installed=""
  wanted=$(tr ',' '\n' <<<"$BASE_EXTRAS,${1:-}" | sed '/^$/d' | sort -u | paste -sd, -)
  for extra in ${wanted//,/ }; do [[ ",${installed:-}," == *",$extra,"* ]] || missing+=("$extra"); done
  if [ -x .venv/bin/python ] && [ ${#missing[@]} -eq 0 ]; then
    return 0
  fi
  [ -n "${installed:-}" ] && wanted=$(tr ',' '\n' <<<"$wanted,$installed" | sort -u | paste -sd, -)
  say "installing the project into .venv with its extras $wanted"
  [ -x .venv/bin/python ] || python3 -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[$wanted]"
  echo "$sha $wanted" > "$stamp"
}

setup() {
  install_debian_packages "${DEB_PACKAGES[@]}"
  install_python_env "${1:-}"
}

# PyTorch for a drill of the PyTorch job only (--trainer torch)
drill_extras() {
  local previous=""
  for arg in "$@"; do
    [[ $arg == --trainer=torch || ( $previous == --trainer && $arg == torch ) ]] && echo torch
    previous=$arg
  done
  return 0
}

# Every check runs, so that one pass shows every finding; the status says whether any found one.
check() {
  install_debian_packages python3-venv
  install_python_env
  local failed=()
  say "ruff format --check"; .venv/bin/ruff format --check . || failed+=("ruff format")
  say "ruff check"; .venv/bin/ruff check . || failed+=("ruff check")
  say "mypy"; .venv/bin/mypy || failed+=(mypy)
  say "lint-imports"; .venv/bin/lint-imports || failed+=(lint-imports)
  if [ ${#failed[@]} -gt 0 ]; then
    say "failed: ${failed[*]} (ruff format . and ruff check --fix . fix what they can)"; return 1
  fi
  say "every check passed"
}

case "${1:-}" in
  drill) shift; setup "$(drill_extras "$@")"; exec .venv/bin/recovery drill "$@" ;;
  test) shift; setup frameworks; exec .venv/bin/python -m pytest "$@" ;;
  test-fast) shift; setup; exec .venv/bin/python -m pytest -n 2 tests/unit tests/replay "$@" ;;
  check) check ;;
  setup) setup ;;
  *) echo "usage: $0 drill [options] | test [pytest arguments] | test-fast [pytest arguments] | check | setup" >&2
     exit 2 ;;
esac
