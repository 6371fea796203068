#!/usr/bin/env bash
# Start a real one-node SLURM cluster on this machine (Debian's slurm-wlm and munge), for tests of the SLURM
# executor. Needs root and apt. Idempotent: a cluster that already answers `sinfo` is left as it is.
#   start:  bash .ci/slurm-single-node.sh        (prints "slurm: ready (partition debug, N CPUs)")
#   stop:   bash .ci/slurm-single-node.sh stop
# Jobs run as root on this host in partition "debug"; slurmctld/slurmd logs are in /var/log/slurm.
set -euo pipefail
if [ "${1:-}" = stop ]; then
  for d in slurmd slurmctld munged; do pid=$(pgrep -x "$d" || true); [ -z "$pid" ] || kill $pid; done
  echo "slurm: stopped"; exit 0
fi
if command -v sinfo >/dev/null 2>&1 && timeout 5 sinfo -h >/dev/null 2>&1; then
  echo "slurm: ready (already running)"; exit 0
fi
[ "$(id -u)" = 0 ] || { echo "slurm: needs root" >&2; exit 1; }
if ! command -v slurmctld >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
fi
host=$(hostname -s); cpus=$(nproc); mem=$(( $(free -m | awk '/Mem:/{print $2}') - 1024 ))
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge /var/lib/munge /var/log/munge /etc/munge
[ -s /etc/munge/munge.key ] || head -c 1024 /dev/urandom > /etc/munge/munge.key
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge; chmod 400 /etc/munge/munge.key
cat > /etc/slurm/slurm.conf <<CONF
ClusterName=local
SlurmctldHost=$host
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SlurmUser=root
SlurmdUser=root
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ReturnToService=2
MpiDefault=none
NodeName=$host CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged
# -c: start from an empty queue. This script starts the cluster only where none answers, so any job in the saved
# state is a ghost of an earlier cluster on this host (its processes are gone) that would hold the node forever.
pgrep -x slurmctld >/dev/null || /usr/sbin/slurmctld -c
pgrep -x slurmd >/dev/null || /usr/sbin/slurmd
for _ in $(seq 30); do
  if sinfo -h -o '%t' 2>/dev/null | grep -q idle; then echo "slurm: ready (partition debug, $cpus CPUs)"; exit 0; fi
  sleep 1
done
echo "slurm: did not become ready; see /var/log/slurm" >&2; exit 1
