#!/usr/bin/env bash
# A real Slurm cluster on this one machine, from Debian's packages: munged, slurmctld,
# NODES compute nodes plus SPARES hot spares (each slurmd in its own PID/UTS namespace, so
# that killing a node kills its jobs as a host death would), and slurmrestd with JWT on
# 127.0.0.1. Nothing goes to /etc: every daemon reads $BASE/etc/slurm.conf.
#
# Slurm runs from the host's packages, or from a Debian root of another release
# (SLURM_ROOT, built by slurm-root.sh) to run the other Slurm generation side by side. In a
# root, every daemon and client runs as `unshare --mount-proc=ROOT/proc -- chroot ROOT ...`:
# its /proc is mounted in a private mount namespace that dies with it, so nothing is ever
# mounted in the host's. BASE is then a real directory inside the root (ROOT$BASE) and a host
# symlink to it, so every path (config, logs, job output, checkpoints) is the same inside and
# out. Client wrappers in $BASE/bin run the root's Slurm commands for this cluster.
# What differs between Slurm generations is keyed on the version of the binaries
# (slurmctld -V), never on the Debian release.
#
#   slurm-cluster.sh start|stop|status|env|version|node-kill NODE|slurmctld-restart|token
#
# Knobs (environment): SLURM_BASE (/tmp/training-recovery/slurm), SLURM_NODES (4),
# SLURM_SPARES (1), SLURM_CLOUD_NODES (0: nodes without a slurmd, powered-down cloud nodes that
# Slurm lists and lets you drain, in a partition of their own; for a cluster of fleet size),
# SLURM_PORT_BASE (16800: ctld +17, restd +20, slurmd +101..),
# SLURM_ROOT (empty: the host's Slurm), SLURM_CLEAN_STATE (empty; 1: a start that finds no
# slurmctld running forgets the saved nodes and jobs), SLURM_TOKEN_LIFESPAN (3600: seconds a
# slurmrestd JWT is valid). The JWT (root's) is in $BASE/etc/slurmrestd.jwt, mode 0600, never in
# env.sh: a renewer started with the cluster replaces it at half its lifespan, and `token` does
# now; the worker reads the file again when it changes (SLURMRESTD_TOKEN_FILE). start is idempotent: a running cluster with the same
# knobs is left alone; with other knobs it is restarted (a BASE keeps its SLURM_ROOT: stop it
# and remove BASE to move it). stop kills only processes of this BASE: those in its pid files,
# its nodes' namespaces, and (in a root) the root's processes configured by its slurm.conf.
set -euo pipefail

BASE=${SLURM_BASE:-/tmp/training-recovery/slurm}
case "$BASE" in /*) ;; *) BASE=$PWD/$BASE ;; esac
BASE=${BASE%/}
ROOT=${SLURM_ROOT:-}
ROOT=${ROOT%/}
NODES=${SLURM_NODES:-4}
SPARES=${SLURM_SPARES:-1}
CLOUD=${SLURM_CLOUD_NODES:-0}
[[ $CLOUD =~ ^[0-9]+$ ]] || { echo "slurm-cluster: error: SLURM_CLOUD_NODES=$CLOUD: a count of nodes" >&2; exit 2; }
PORT_BASE=${SLURM_PORT_BASE:-16800}
TOKEN_LIFESPAN=${SLURM_TOKEN_LIFESPAN:-3600}
[[ $TOKEN_LIFESPAN =~ ^[0-9]+$ ]] && [ "$TOKEN_LIFESPAN" -ge 2 ] || {
  echo "slurm-cluster: error: SLURM_TOKEN_LIFESPAN=$TOKEN_LIFESPAN: seconds, at least 2" >&2; exit 2; }
CTLD_PORT=$((PORT_BASE + 17))
RESTD_PORT=$((PORT_BASE + 20))
SLURMD_PORT0=$((PORT_BASE + 100))
CONF=$BASE/etc/slurm.conf
TOKEN_FILE=$BASE/etc/slurmrestd.jwt
IN_ROOT=()
SPARE_REASON="recovery: hot spare standby"
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PACKAGES=(slurmctld slurmd slurm-client slurmrestd munge slurm-wlm-jwt-plugin)

log() { echo "slurm-cluster: $*" >&2; }
die() { log "error: $*"; exit 1; }

# --- where Slurm runs from ---------------------------------------------------------------------

# The root a BASE was set up in: BASE is then a symlink to ROOT$BASE.
root_of_base() {
  [ -L "$BASE" ] || return 0
  local target; target=$(readlink "$BASE")
  [ "${target%"$BASE"}" != "$target" ] && echo "${target%"$BASE"}"
  return 0
}

# Set IN_ROOT, the prefix that runs a command from ROOT (empty on the host).
use_root() {
  ROOT=$1
  IN_ROOT=()
  [ -n "$ROOT" ] && IN_ROOT=(unshare --mount-proc="$ROOT/proc" -- chroot "$ROOT")
  return 0
}

slurm() { SLURM_CONF=$CONF "${IN_ROOT[@]}" "$@"; }

ensure_packages() {
  local missing=()
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  [ "$(id -u)" -eq 0 ] || die "packages missing (${missing[*]}); run as root or install them"
  log "installing ${missing[*]}"
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# Make sure Slurm is there and set VERSION (e.g. 24.11.5) from slurmctld -V.
ensure_slurm() {
  if [ -n "$ROOT" ]; then
    [ "$(id -u)" -eq 0 ] || die "running Slurm from a root (SLURM_ROOT) needs root"
    [ -x "$ROOT/usr/sbin/slurmctld" ] ||
      die "no Slurm in $ROOT: build the root with $HERE/slurm-root.sh build $ROOT RELEASE"
    # munge and Slurm resolve this machine's names through the root's /etc/hosts
    cp /etc/hosts "$ROOT/etc/hosts"
  else
    ensure_packages
  fi
  VERSION=$("${IN_ROOT[@]}" slurmctld -V 2>/dev/null | awk '{print $2}') || true
  [ -n "$VERSION" ] || die "cannot tell the Slurm version (slurmctld -V)"
}

# version_at_least 24.05: the binaries are Slurm 24.05 or later
version_at_least() { [ "$(printf '%s\n' "$1" "$VERSION" | sort -V | head -1)" = "$1" ]; }

generation() { echo "$VERSION" | cut -d. -f1,2; }

# BASE must be where this mode keeps it: a real directory for the host's Slurm, a symlink to
# ROOT$BASE for a root's. Moving a BASE between the two would leave a stale half behind.
place_base() {
  local current; current=$(root_of_base)
  if [ -d "$BASE" ] && [ ! -L "$BASE" ] && [ -n "$ROOT" ]; then
    rmdir "$BASE" 2>/dev/null ||
      die "$BASE belongs to a cluster of the host's Slurm: stop it and remove $BASE, or choose another SLURM_BASE"
  fi
  if [ -L "$BASE" ] && [ "$current" != "$ROOT" ]; then
    die "$BASE belongs to a cluster run from ${current:-elsewhere}: stop it and remove $BASE, or choose another SLURM_BASE"
  fi
  if [ -n "$ROOT" ]; then
    mkdir -p "$ROOT$BASE" "$(dirname "$BASE")"
    [ -L "$BASE" ] || ln -s "$ROOT$BASE" "$BASE"
  else
    mkdir -p "$BASE"
  fi
}

# --- configuration -----------------------------------------------------------------------------

node_names() {
  local i
  for ((i = 1; i <= NODES + SPARES; i++)); do echo "gpu-$i"; done
}

spare_names() {
  local i
  for ((i = NODES + 1; i <= NODES + SPARES; i++)); do echo "gpu-$i"; done
}

knobs() { echo "nodes=$NODES spares=$SPARES cloud=$CLOUD ports=$PORT_BASE base=$BASE root=${ROOT:-host}"; }

# The pid in a pid file while its process runs; empty for a stale file, whose pid may belong to
# another process by now (pids wrap around at pid_max, and start over at a reboot): a process
# that started after its pid file was written is not the one the file names. Never fails.
PID_START_MARGIN=30

pid_in() {
  local pid ticks boot
  pid=$(cat "$1" 2>/dev/null) || return 0
  [[ $pid =~ ^[0-9]+$ ]] || return 0
  # field 22 of /proc/PID/stat, the start in clock ticks since boot (the name before it may hold spaces)
  ticks=$(sed 's/.*) //' "/proc/$pid/stat" 2>/dev/null | cut -d' ' -f20) || return 0
  [ -n "$ticks" ] || return 0
  boot=$(awk '/^btime/ {print $2}' /proc/stat)
  # A process started after the file was written is another one (pids wrap at pid_max, 32768 here).
  # The margin allows for the wall clock stepped since: btime moves with it, and with a margin of
  # 1 s a live node read as gone (node-kill: "no running node gpu-4", once in a CI run).
  if [ $((boot + ticks / $(getconf CLK_TCK))) -le $(($(stat -c %Y "$1") + PID_START_MARGIN)) ]; then echo "$pid"; fi
}

alive() { local pid; pid=$(pid_in "$1"); [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; }

write_config() {
  if [ -n "${SLURM_CLEAN_STATE:-}" ] && ! alive "$BASE/run/slurmctld.pid"; then
    log "starting from a clean state (SLURM_CLEAN_STATE)"
    rm -rf "$BASE/state" "$BASE/spool"
  fi
  mkdir -p "$BASE"/{etc,state,spool,log,run,munge,dev,bin,faults}
  # Saved jobs and nodes are readable only by the next Slurm releases: a new generation
  # (another root, or the host upgraded to the next Debian) starts from a clean state.
  local saved; saved=$(cat "$BASE/state/generation" 2>/dev/null || true)
  if [ -n "$saved" ] && [ "$saved" != "$(generation)" ] && ! alive "$BASE/run/slurmctld.pid"; then
    log "Slurm $saved -> $(generation): starting from a clean state"
    rm -rf "$BASE/state" "$BASE/spool"
    mkdir -p "$BASE/state" "$BASE/spool"
  fi
  generation > "$BASE/state/generation"
  chmod 0755 "$BASE/munge"
  for g in 0 1 2 3 4 5 6 7; do ln -sfn /dev/null "$BASE/dev/nvidia$g"; done
  [ -s "$BASE/munge/munge.key" ] || { dd if=/dev/urandom of="$BASE/munge/munge.key" bs=1024 count=1 status=none; chmod 0400 "$BASE/munge/munge.key"; }
  [ -s "$BASE/etc/jwt_hs256.key" ] || { dd if=/dev/urandom of="$BASE/etc/jwt_hs256.key" bs=32 count=1 status=none; }
  # only slurmctld (root) reads the key: 24.11 warns when SlurmUser does not own it
  chown 0:0 "$BASE/etc/jwt_hs256.key"
  chmod 0600 "$BASE/etc/jwt_hs256.key"
  local total=$((NODES + SPARES))
  {
    echo "# generated by deploy/local/slurm-cluster.sh for Slurm $VERSION; $(knobs)"
    cat <<CONF
ClusterName=recoverylocal
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire bounds how soon a requeued job may start again (Slurm's default, 120 s)
AuthInfo=socket=$BASE/munge/munge.socket.2,cred_expire=10
AuthAltTypes=auth/jwt
AuthAltParameters=jwt_key=$BASE/etc/jwt_hs256.key
StateSaveLocation=$BASE/state
SlurmdSpoolDir=$BASE/spool/%n
SlurmctldPidFile=$BASE/run/slurmctld.pid
SlurmdPidFile=$BASE/spool/%n/slurmd.pid
SlurmctldLogFile=$BASE/log/slurmctld.log
SlurmdLogFile=$BASE/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$BASE/log/jobcomp.log
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
MpiDefault=none
SwitchType=switch/none
GresTypes=gpu
# each node advertises 8 CPUs and 8 (fake) GPUs on this small machine
SlurmdParameters=config_overrides
ReturnToService=1
JobRequeue=1
SlurmdTimeout=10
SlurmctldTimeout=30
MessageTimeout=5
InactiveLimit=0
KillWait=5
MinJobAge=600
MailProg=/bin/true
CONF
    local i
    for ((i = 1; i <= total; i++)); do
      echo "NodeName=gpu-$i NodeAddr=127.0.0.$((i + 1)) Port=$((SLURMD_PORT0 + i)) CPUs=8 RealMemory=64000 Gres=gpu:8 State=UNKNOWN"
    done
    echo "PartitionName=gpu Nodes=gpu-[1-$total] Default=YES MaxTime=INFINITE State=UP"
    if [ "$CLOUD" -gt 0 ]; then
      # Powered down from the start and never resumed (no job is sent to their partition unless
      # asked), drained like any node. PrivateData=cloud: slurm.conf(5) of 22.05 hides powered-down
      # cloud nodes from sinfo, scontrol and slurmrestd without it.
      echo "PrivateData=cloud"
      echo "SuspendProgram=/bin/true"
      echo "ResumeProgram=/bin/true"
      echo "NodeName=gpu-[$((total + 1))-$((total + CLOUD))] CPUs=8 RealMemory=64000 Gres=gpu:8 State=CLOUD"
      echo "PartitionName=cloud Nodes=gpu-[$((total + 1))-$((total + CLOUD))] MaxTime=INFINITE State=UP"
    fi
    # 25.11+: a job submitted --requeue=expedite is requeued by slurmctld itself when its node
    # fails, at the top of the queue and eligible at once (no requeue_delay)
    if version_at_least 25.11; then echo "SlurmctldParameters=enable_expedited_requeue"; fi
  } > "$BASE/etc/slurm.conf.new"
  echo "NodeName=gpu-[1-$total] Name=gpu File=$BASE/dev/nvidia[0-7]" > "$BASE/etc/gres.conf"
  if version_at_least 24.05; then
    # slurmd 24.x always loads a cgroup plugin, and there is no cgroup fs here (nor in a
    # root); "disabled" exists since 24.05, and 22.05 loads none with proctrack/linuxproc
    echo "CgroupPlugin=disabled" > "$BASE/etc/cgroup.conf"
  else
    rm -f "$BASE/etc/cgroup.conf"
  fi
  mv "$BASE/etc/slurm.conf.new" "$CONF"
  # the node init must be reachable inside the root too
  cp "$HERE/slurm-node-init.sh" "$BASE/bin/node-init"
  [ -n "$ROOT" ] && write_client_wrappers
  return 0
}

# $BASE/bin/<command> for every Slurm client command of the root: with SLURM_CONF pointing
# into the root they run the root's binary (a client talks only to its own generation's
# slurmctld), otherwise the host's. Inside the root (a job that inherited PATH) they run the
# root's binary directly. The caller's directory is kept, its physical path under ROOT
# translated, so `sbatch` gets the right working directory.
write_client_wrappers() {
  local wrapper=$BASE/bin/slurm-client name
  cat > "$wrapper.new" <<WRAPPER
#!/bin/sh
# generated by deploy/local/slurm-cluster.sh: Slurm $VERSION's clients from $ROOT
root=$ROOT
name=\$(basename "\$0")
if [ -d "\$root" ] && [ -n "\${SLURM_CONF:-}" ] && [ -e "\$root\$SLURM_CONF" ]; then
  cwd=\$(pwd -P)
  case "\$cwd" in "\$root"/*) cwd=\${cwd#"\$root"} ;; esac
  exec unshare --mount-proc="\$root/proc" -- chroot "\$root" \\
    /bin/sh -c 'cd "\$1" 2>/dev/null || cd /; shift; exec "\$@"' sh "\$cwd" "/usr/bin/\$name" "\$@"
fi
exec "/usr/bin/\$name" "\$@"
WRAPPER
  chmod 0755 "$wrapper.new"
  mv "$wrapper.new" "$wrapper"
  for name in $("${IN_ROOT[@]}" dpkg-query -L slurm-client | sed -n 's#^/usr/bin/##p'); do
    ln -sfn slurm-client "$BASE/bin/$name"
  done
}

write_env() {
  cat > "$BASE/env.sh" <<ENV
# source me: the local Slurm cluster started by deploy/local/slurm-cluster.sh
export SLURM_CONF=$CONF
export SLURMRESTD_URL=http://127.0.0.1:$RESTD_PORT
export SLURMRESTD_USER=root
export SLURMRESTD_TOKEN_FILE=$TOKEN_FILE
export SLURM_LOCAL_BASE=$BASE
export SLURM_SPARE_NODES=$(spare_names | paste -sd, -)
# the Slurm commands to use for this cluster (empty: those on PATH) and their version
export SLURM_BIN_DIR=${ROOT:+$BASE/bin}
export SLURM_VERSION=$VERSION
ENV
  if [ -n "$ROOT" ]; then
    echo "case \":\$PATH:\" in *\":\$SLURM_BIN_DIR:\"*) ;; *) PATH=\$SLURM_BIN_DIR:\$PATH ;; esac" >> "$BASE/env.sh"
  fi
}

# --- daemons -----------------------------------------------------------------------------------

start_munge() {
  alive "$BASE/run/munged.pid" && return 0
  slurm munged --key-file="$BASE/munge/munge.key" --socket="$BASE/munge/munge.socket.2" \
    --pid-file="$BASE/run/munged.pid" --log-file="$BASE/log/munged.log" --seed-file="$BASE/munge/seed" --force
  wait_until "munged" 50 slurm munge -n -S "$BASE/munge/munge.socket.2"
}

start_slurmctld() {
  alive "$BASE/run/slurmctld.pid" && return 0
  SLURM_CONF=$CONF setsid "${IN_ROOT[@]}" slurmctld -f "$CONF" -i </dev/null >>"$BASE/log/slurmctld.out" 2>&1
  wait_until "slurmctld (see $BASE/log/slurmctld.log)" 100 ctld_up
}

ctld_up() { slurm scontrol ping 2>/dev/null | grep -q "is UP"; }

use_pid_namespaces() { unshare --pid --fork --mount-proc --uts true 2>/dev/null; }

start_node() {
  local node=$1 pidfile="$BASE/run/node-$1.pid"
  alive "$pidfile" && return 0
  mkdir -p "$BASE/spool/$node"
  if [ -n "$ROOT" ]; then
    # The namespace's proc and a private devpts (srun --pty) are mounted in its own mount
    # namespace, then its init is chrooted. A slurmd before 24.05 cannot run without a cgroup
    # plugin (24.05 added CgroupPlugin=disabled): it gets an empty cgroup v1 layout of its own,
    # which its autodetection accepts and proctrack/linuxproc + task/none never use, whatever
    # the host's cgroup layout.
    local fake_cgroups=; version_at_least 24.05 || fake_cgroups=yes
    mkdir -p "$ROOT/sys/fs/cgroup"
    SLURM_CONF=$CONF FAKE_CGROUPS=$fake_cgroups setsid unshare --pid --fork --uts --kill-child --mount-proc="$ROOT/proc" -- \
      sh -ec '
        mount -t devpts -o newinstance,ptmxmode=0666,mode=620 devpts "$0/dev/pts"
        if [ -n "$FAKE_CGROUPS" ]; then
          mount -t tmpfs -o mode=0755,size=64k cgroups "$0/sys/fs/cgroup"
          mkdir "$0/sys/fs/cgroup/systemd"
          mount -t cgroup -o none,name=training-recovery cgroup "$0/sys/fs/cgroup/systemd"
        fi
        exec chroot "$0" "$@"' \
      "$ROOT" bash "$BASE/bin/node-init" "$node" </dev/null >>"$BASE/log/node-$node.out" 2>&1 &
  elif use_pid_namespaces; then
    # PID 1 of the node's namespace is a small init that reaps what slurmd leaves behind
    SLURM_CONF=$CONF setsid unshare --pid --fork --mount-proc --uts --kill-child \
      bash "$BASE/bin/node-init" "$node" </dev/null >>"$BASE/log/node-$node.out" 2>&1 &
  else
    SLURM_CONF=$CONF setsid slurmd -D -N "$node" </dev/null >>"$BASE/log/node-$node.out" 2>&1 &
  fi
  echo $! > "$pidfile"
}

# Sets RESTD, slurmrestd's command line as this generation lets it run. It refuses to run as root
# (22.05) or as SlurmUser (24.11; SlurmUser=root here) unless told not to check: as another user
# (-u slurm) it could not read a slurm.conf under a private directory (such as pytest's tmp_path).
# 26.05 makes that switch fatal (measured on 26.05.5): there it runs as the packages'
# unprivileged slurm user, which must be able to read BASE.
restd_command() {
  if version_at_least 26.05; then
    RESTD=(env "SLURM_CONF=$CONF" "${IN_ROOT[@]}" slurmrestd -u slurm -g slurm)
  else
    RESTD=(env "SLURM_CONF=$CONF" SLURMRESTD_SECURITY=disable_user_check "${IN_ROOT[@]}" slurmrestd)
  fi
}

# The REST API plugins (-s) and the newest API version this slurmrestd serves. 22.05 has one
# plugin per API version (openapi/v0.0.36-38; the dbv0.0.x ones need slurmdbd); from 23.02
# on, openapi/slurmctld serves every version of its data parsers (24.11: v0.0.40-42).
restd_plugins() {
  if version_at_least 23.02; then
    echo openapi/slurmctld
  else
    restd_command; "${RESTD[@]}" -s list 2>&1 | grep -o 'openapi/v0\.0\.[0-9]*' | sort -uV | paste -sd, -
  fi
}

restd_newest_version() {
  if version_at_least 23.02; then
    restd_command; "${RESTD[@]}" -d list 2>&1 | grep -o 'v0\.0\.[0-9]*' | sort -V | tail -1
  else
    restd_plugins | tr ',' '\n' | sort -V | tail -1 | sed 's#openapi/##'
  fi
}

start_slurmrestd() {
  local pidfile="$BASE/run/slurmrestd.pid"
  alive "$pidfile" && return 0
  # JWT needs SLURM_JWT=daemon
  restd_command
  SLURM_JWT=daemon setsid "${RESTD[@]}" -a rest_auth/jwt -s "$(restd_plugins)" "127.0.0.1:$RESTD_PORT" \
    </dev/null >>"$BASE/log/slurmrestd.log" 2>&1 &
  echo $! > "$pidfile"
}

# Up to `tries` looks, 0.1 s apart (plus each look's own time); on timeout, what the last one said.
wait_until() {
  local what=$1 tries=$2; shift 2
  local t said
  for ((t = 0; t < tries; t++)); do said=$("$@" 2>&1 >/dev/null) && return 0; sleep 0.1; done
  die "timed out waiting for $what${said:+: $(tail -n 1 <<<"$said")}"
}

nodes_registered() {
  # every node answers (no '*' = not responding, no 'unk' = never registered); a node an
  # operator or an incident set DOWN is registered all the same (and stays DOWN)
  local states
  states=$(slurm sinfo -h -N -o '%T' 2>/dev/null) || return 1
  [ -n "$states" ] && ! grep -qE '\*|unknown|not_responding' <<<"$states"
}

# A new JWT for root into TOKEN_FILE: written beside it with mode 0600, then renamed over it, so
# that a reader sees the old token or the new one, never half of one.
issue_token() {
  local token
  token=$(slurm scontrol token username=root lifespan="$TOKEN_LIFESPAN" | sed 's/^SLURM_JWT=//')
  [ -n "$token" ] || die "scontrol token gave no token"
  rm -f "$TOKEN_FILE.new"
  (umask 077 && printf '%s\n' "$token" > "$TOKEN_FILE.new")
  mv -f "$TOKEN_FILE.new" "$TOKEN_FILE"
}

# Renew the token at half its lifespan, for as long as the cluster runs (a failed renewal is
# tried again in 10 s: the old token is still valid for the other half).
renew_tokens() {
  while :; do
    if sleep $((TOKEN_LIFESPAN / 2)) && (issue_token); then continue; fi  # (): its die ends the subshell only
    log "token renewal failed; trying again in 10 s"; sleep 10
  done
}

start_token_renewer() {
  local pidfile="$BASE/run/token-renewer.pid" pid
  # One renewer, with this start's lifespan: the one before goes, with its sleep (its own group).
  pid=$(pid_in "$pidfile")
  [ -z "$pid" ] || kill -TERM -- "-$pid" 2>/dev/null || true
  setsid bash "$HERE/slurm-cluster.sh" renew-tokens </dev/null >>"$BASE/log/token-renewer.log" 2>&1 &
  echo $! > "$pidfile"
}

restd_answers() {
  # a slurmrestd that exited (say, its port held by another socket) says why in its log's last line
  alive "$BASE/run/slurmrestd.pid" || { echo "slurmrestd exited: $(tail -n 1 "$BASE/log/slurmrestd.log")" >&2; return 1; }
  curl -fsS -o /dev/null -H "X-SLURM-USER-NAME: root" -H "X-SLURM-USER-TOKEN: $1" \
    "http://127.0.0.1:$RESTD_PORT/slurm/$2/ping"
}

# --- commands ----------------------------------------------------------------------------------

cmd_start() {
  use_root "$ROOT"
  command -v curl >/dev/null || die "curl is needed"
  ensure_slurm
  if [ -f "$BASE/knobs" ] && [ "$(cat "$BASE/knobs")" != "$(knobs)" ]; then
    [ "$(root_of_base)" = "$ROOT" ] || place_base  # dies with the reason, before stopping anything
    log "knobs changed: restarting"; cmd_stop
  fi
  place_base
  write_config
  knobs > "$BASE/knobs"
  start_munge
  start_slurmctld
  local node
  for node in $(node_names); do start_node "$node"; done
  wait_until "nodes to register (see $BASE/log/node-*.out and slurmd-*.log)" 150 nodes_registered
  local shown
  for node in $(spare_names); do
    # A hot spare waits out of service until an incident brings it in; one an incident has claimed
    # (its comment names the incident) is in service for good: a restart must not undo a recovery.
    # scontrol leaves out a comment that is not set (22.05 and 24.11 here; "Comment=(null)" elsewhere).
    shown=$(slurm scontrol show node -o "$node" 2>/dev/null) || true
    [[ $shown == *" Comment="* && $shown != *" Comment=(null)"* ]] && continue
    slurm scontrol update NodeName="$node" State=DRAIN Reason="$SPARE_REASON" 2>/dev/null || true
  done
  local api
  issue_token
  start_token_renewer
  start_slurmrestd
  api=$(restd_newest_version)
  # 30 s: on a loaded 2-core machine slurmctld's first answers through slurmrestd took over 10 s
  wait_until "slurmrestd (see $BASE/log/slurmrestd.log)" 300 restd_answers "$(cat "$TOKEN_FILE")" "$api"
  write_env
  log "up: Slurm $VERSION${ROOT:+ from $ROOT}: $(node_names | paste -sd' ' -) (spares: $(spare_names | paste -sd' ' -)); source $BASE/env.sh"
}

# Wait for each pid to end (10 s at most each), then SIGKILL it.
wait_gone() {
  local pid t
  for pid in "$@"; do
    for t in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
  done
}

# What is left of this cluster in its root after the daemons are gone: processes running from
# ROOT whose environment names this BASE's slurm.conf (e.g. a client stuck on a dead slurmctld).
sweep_root() {
  [ -n "$ROOT" ] || return 0
  local p pids=() t
  for p in /proc/[0-9]*; do
    [ "$(readlink "$p/root" 2>/dev/null)" = "$ROOT" ] || continue
    tr '\0' '\n' <"$p/environ" 2>/dev/null | grep -qxF "SLURM_CONF=$CONF" || continue
    pids+=("${p#/proc/}")
  done
  [ ${#pids[@]} -eq 0 ] && return 0
  log "killing leftover processes in $ROOT: ${pids[*]}"
  kill -KILL "${pids[@]}" 2>/dev/null || true
  for t in $(seq 50); do kill -0 "${pids[@]}" 2>/dev/null || return 0; sleep 0.1; done
}

cmd_stop() {
  use_root "$(root_of_base)"
  [ -d "$BASE/run" ] || return 0
  # the pids are read first: a daemon removes its pid file as it exits (unquoted below: an
  # empty pid is no argument)
  local restd ctld munged renewer f pid nodes=()
  renewer=$(pid_in "$BASE/run/token-renewer.pid")
  [ -z "$renewer" ] || kill -TERM -- "-$renewer" 2>/dev/null || true
  restd=$(pid_in "$BASE/run/slurmrestd.pid")
  ctld=$(pid_in "$BASE/run/slurmctld.pid")
  munged=$(pid_in "$BASE/run/munged.pid")
  kill -TERM $restd $ctld 2>/dev/null || true
  for f in "$BASE"/run/node-*.pid; do
    pid=$(pid_in "$f")
    [ -n "$pid" ] || continue
    # in pidns mode the namespace's init dies with its children (--kill-child); else the slurmd
    pkill -KILL -P "$pid" 2>/dev/null || true
    kill -KILL "$pid" 2>/dev/null || true
    nodes+=("$pid")
  done
  # Without PID namespaces a node's job processes outlive its slurmd: find this cluster's
  # slurmstepd by their sockets in its spool directory, and kill them with their children.
  for pid in $(ss -xlpn 2>/dev/null | grep -F "$BASE/spool/" | grep -o 'pid=[0-9]*' | cut -d= -f2 | sort -u); do
    pkill -KILL -P "$pid" 2>/dev/null || true
    kill -KILL "$pid" 2>/dev/null || true
  done
  kill -TERM $munged 2>/dev/null || true
  wait_gone $restd $ctld "${nodes[@]}" $munged
  rm -f "$BASE"/run/*.pid
  sweep_root
  rm -f "$BASE/knobs"
  log "stopped"
}

# A node's hardware death: SIGKILL to everything in its namespace (slurmd and its jobs). `start`
# brings it back, as a repaired node that boots again.
cmd_node_kill() {
  local node=${1:?usage: node-kill NODE} pid
  [[ $node =~ ^[A-Za-z0-9._-]+$ ]] || die "invalid node name: $node"
  pid=$(pid_in "$BASE/run/node-$node.pid")
  [ -n "$pid" ] || die "no running node $node in $BASE"
  pkill -KILL -P "$pid" 2>/dev/null || true
  kill -KILL "$pid" 2>/dev/null || true
  wait_gone "$pid"
  rm -f "$BASE/run/node-$node.pid"
}

# A controller restart: slurmctld alone stops (SIGTERM, SIGKILL after 10 s) and starts again on
# the same slurm.conf and saved state; the nodes and their jobs go on.
cmd_slurmctld_restart() {
  use_root "$(root_of_base)"
  local pid
  pid=$(pid_in "$BASE/run/slurmctld.pid")
  [ -n "$pid" ] || die "no running slurmctld in $BASE"
  kill -TERM "$pid" 2>/dev/null || true
  wait_gone "$pid"
  rm -f "$BASE/run/slurmctld.pid"
  start_slurmctld
}

cmd_status() {
  local f ok=0
  for f in munged slurmctld slurmrestd; do
    if alive "$BASE/run/$f.pid"; then echo "$f: running"; else echo "$f: stopped"; ok=1; fi
  done
  for f in $(node_names); do
    if alive "$BASE/run/node-$f.pid"; then echo "$f: running"; else echo "$f: stopped"; ok=1; fi
  done
  return $ok
}

case "${1:-}" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  env) cat "$BASE/env.sh" ;;
  node-kill) cmd_node_kill "${2:-}" ;;
  slurmctld-restart) cmd_slurmctld_restart ;;
  token) use_root "$(root_of_base)"; issue_token ;;
  renew-tokens) use_root "$(root_of_base)"; renew_tokens ;;
  version) use_root "$ROOT"; ensure_slurm; echo "$VERSION" ;;
  *) echo "usage: $0 start|stop|status|env|version|node-kill NODE|slurmctld-restart|token" >&2; exit 2 ;;
esac
