#!/usr/bin/env bash
# A Debian root (debootstrap --variant=minbase) holding another Debian release's Slurm, so that
# slurm-cluster.sh (SLURM_ROOT=ROOT) can run that Slurm generation next to the host's own.
#
#   slurm-root.sh build ROOT RELEASE   make ROOT a ready root of RELEASE (idempotent)
#   slurm-root.sh check ROOT RELEASE   exit 0 if ROOT is a ready root of RELEASE
#
# build installs debootstrap on the host if missing, debootstraps into ROOT.partial (so a
# half-built tree never sits at ROOT), then installs Slurm, munge and python3 (the
# reference training job runs inside the root). A ROOT of another release, or broken, is
# deleted and built again, never while anything is mounted under it or running from it.
# Knob: DEBIAN_MIRROR (http://deb.debian.org/debian).
#
# RELEASE may be sid (unstable, which has Slurm 26.05): its roots say "forky/sid" in
# /etc/debian_version, and mirrors have been measured serving a sid InRelease whose Valid-Until
# lay weeks in the past, which apt refuses unless told not to check it (sid is built once here and
# kept; the run records the exact Slurm version it used).
set -euo pipefail

MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
# systemd-standalone-sysusers satisfies slurm-wlm-basic-plugins' sysusers dependency without
# pulling in systemd; python3 runs the reference training job (python3-minimal lacks shutil)
PACKAGES=(slurmctld slurmd slurm-client slurmrestd munge slurm-wlm-jwt-plugin systemd-standalone-sysusers python3)
MARKER=etc/training-recovery-root

log() { echo "slurm-root: $*" >&2; }
die() { log "error: $*"; exit 1; }

usage() { echo "usage: $0 build|check ROOT RELEASE" >&2; exit 2; }

[ $# -eq 3 ] || usage
ACTION=$1
ROOT=$2
RELEASE=$3
case "$ROOT" in /*) ;; *) die "ROOT must be an absolute path: $ROOT" ;; esac
ROOT=${ROOT%/}

expected_marker() { echo "release=$RELEASE packages=${PACKAGES[*]}"; }

# Every namespace counts: a daemon started by slurm-cluster.sh has ROOT/proc mounted in its own
# private mount namespace, invisible in the host's.
in_use() {
  local dir=$1 p
  cat /proc/[0-9]*/mountinfo 2>/dev/null |
    awk -v d="$dir" '$5 == d || index($5, d "/") == 1 { found = 1 } END { exit !found }' && return 0
  for p in /proc/[0-9]*; do
    case "$(readlink "$p/root" 2>/dev/null)" in "$dir" | "$dir"/*) return 0 ;; esac
  done
  return 1
}

remove_tree() {
  local dir=$1
  [ -e "$dir" ] || return 0
  in_use "$dir" && die "$dir has mounts or processes in it; stop its clusters first (slurm-cluster.sh stop)"
  log "removing $dir"
  rm -rf --one-file-system "$dir"
}

in_root() { unshare --mount-proc="$ROOT/proc" -- chroot "$ROOT" "$@"; }

APT_OPTIONS=()
[ "$RELEASE" = sid ] && APT_OPTIONS=(-o Acquire::Check-Valid-Until=false)

sync_host_files() {
  # minbase has no /etc/hosts: munge and Slurm resolve this machine's names through it
  cp /etc/hosts "$ROOT/etc/hosts"
  cp -L /etc/resolv.conf "$ROOT/etc/resolv.conf" 2>/dev/null || true
}

is_ready() {
  [ "$(cat "$ROOT/$MARKER" 2>/dev/null)" = "$(expected_marker)" ] &&
    in_root slurmctld -V >/dev/null 2>&1 && in_root python3 -c 'import json, hashlib, shutil, secrets, argparse' 2>/dev/null
}

# The release the root holds: a codename, or sid for unstable (whose os-release names the next codename).
codename() {
  case "$(cat "$ROOT/etc/debian_version" 2>/dev/null)" in
    */sid) echo sid ;;
    *) sed -n 's/^VERSION_CODENAME=//p' "$ROOT/etc/os-release" 2>/dev/null ;;
  esac
}

ensure_debootstrap() {
  command -v debootstrap >/dev/null && return 0
  [ "$(id -u)" -eq 0 ] || die "debootstrap is missing; run as root or install it"
  log "installing debootstrap"
  local out
  out=$(apt-get update -qq 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap 2>&1) ||
    die "installing debootstrap failed: $out"
}

bootstrap() {
  ensure_debootstrap
  remove_tree "$ROOT.partial"
  log "debootstrap --variant=minbase $RELEASE $ROOT (from $MIRROR)"
  debootstrap --variant=minbase "$RELEASE" "$ROOT.partial" "$MIRROR" >"$ROOT.debootstrap.log" 2>&1 ||
    die "debootstrap failed: see $ROOT.debootstrap.log"
  mv "$ROOT.partial" "$ROOT"
}

provision() {
  log "installing ${PACKAGES[*]} in $ROOT"
  # no package may start a service inside the root
  printf '#!/bin/sh\nexit 101\n' > "$ROOT/usr/sbin/policy-rc.d"
  chmod 0755 "$ROOT/usr/sbin/policy-rc.d"
  echo "deb $MIRROR $RELEASE main" > "$ROOT/etc/apt/sources.list"
  sync_host_files
  in_root apt-get "${APT_OPTIONS[@]}" update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive in_root apt-get "${APT_OPTIONS[@]}" install -y -qq --no-install-recommends "${PACKAGES[@]}" \
    >"$ROOT.install.log" 2>&1 || die "package installation failed: see $ROOT.install.log"
  # the package cache and lists are half the root's size and are fetched again when needed
  in_root apt-get clean
  rm -rf "$ROOT"/var/lib/apt/lists/*
  expected_marker > "$ROOT/$MARKER"
}

cmd_check() {
  [ -d "$ROOT" ] || die "$ROOT does not exist: build it with $0 build $ROOT $RELEASE"
  sync_host_files
  is_ready || die "$ROOT is not a ready $RELEASE root: build it with $0 build $ROOT $RELEASE"
}

cmd_build() {
  [ "$(id -u)" -eq 0 ] || die "building a root needs root"
  mkdir -p "$(dirname "$ROOT")"
  # one build at a time per root (two test sessions may ask at once)
  exec 9>"$ROOT.lock"
  flock 9
  if [ -d "$ROOT" ]; then
    sync_host_files
    is_ready && return 0
    # a root of another release, or one that debootstrap never finished, cannot be repaired
    if [ "$(codename)" != "$RELEASE" ] || [ ! -x "$ROOT/usr/bin/apt-get" ]; then remove_tree "$ROOT"; fi
  fi
  [ -d "$ROOT" ] || bootstrap
  provision
  is_ready || die "$ROOT was built but does not run slurmctld -V and python3"
  log "ready: $ROOT ($(in_root slurmctld -V))"
}

case "$ACTION" in
  build) cmd_build ;;
  check) cmd_check ;;
  *) usage ;;
esac
