#!/usr/bin/env bash
# Health check hook of the local stack: a node is healthy when its slurmd answers on its port,
# its (fake) GPUs are present and no drill has marked them failed. A real cluster would run its
# GPU diagnostics on the node here (e.g. `srun -w NODE dcgmi diag -r 1`), which proves slurmd
# alive too: slurmctld only sees a dead slurmd after SlurmdTimeout, so its "idle" is not enough.
# Usage: gpu-health.sh NODE [CLUSTER_BASE]
set -eu
node=$1
base=${2:-${SLURM_LOCAL_BASE:?give the cluster base directory or set SLURM_LOCAL_BASE}}
line=$(grep -E "^NodeName=$node " "$base/etc/slurm.conf" || true)
[ -n "$line" ] || { echo "$node: not in $base/etc/slurm.conf"; exit 1; }
addr=$(sed -E 's/.* NodeAddr=([^ ]+).*/\1/' <<<"$line")
port=$(sed -E 's/.* Port=([0-9]+).*/\1/' <<<"$line")
if ! timeout 5 bash -c "exec 3<>/dev/tcp/$addr/$port" 2>/dev/null; then
  echo "$node: slurmd does not answer on $addr:$port"; exit 1
fi
for g in 0 1 2 3 4 5 6 7; do
  [ -e "$base/dev/nvidia$g" ] || { echo "$node: GPU $g missing"; exit 1; }
done
if [ -e "$base/faults/$node" ]; then
  echo "$node: GPU fault marked: $(cat "$base/faults/$node")"; exit 1
fi
echo "$node: slurmd answers, 8 GPUs present, no fault"
