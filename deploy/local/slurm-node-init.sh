#!/usr/bin/env bash
# PID 1 of one local Slurm node's PID namespace: names the host, runs slurmd, and reaps the
# orphaned slurmstepd and job processes that slurmd (not an init) would leave as zombies.
# slurm-cluster.sh runs it as $BASE/bin/node-init, so that it runs inside a Slurm root too.
node=$1
hostname "$node" 2>/dev/null || true
slurmd -D -N "$node" &
slurmd_pid=$!
trap 'kill -TERM $slurmd_pid 2>/dev/null' TERM INT
while kill -0 "$slurmd_pid" 2>/dev/null; do
  wait -n 2>/dev/null || sleep 1
done
