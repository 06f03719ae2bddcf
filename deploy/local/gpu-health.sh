#!/usr/bin/env bash
# Health check hook of the local stack: a node is healthy when its (fake) GPUs are present and
# no drill has marked them failed. A real cluster would run its GPU diagnostics here
# (e.g. `srun -w NODE dcgmi diag -r 1`). Usage: gpu-health.sh NODE [CLUSTER_BASE]
set -eu
node=$1
base=${2:-${SLURM_LOCAL_BASE:?give the cluster base directory or set SLURM_LOCAL_BASE}}
for g in 0 1 2 3 4 5 6 7; do
  [ -e "$base/dev/nvidia$g" ] || { echo "$node: GPU $g missing"; exit 1; }
done
if [ -e "$base/faults/$node" ]; then
  echo "$node: GPU fault marked: $(cat "$base/faults/$node")"; exit 1
fi
echo "$node: 8 GPUs present, no fault"
