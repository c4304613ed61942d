#!/usr/bin/env bash
# Installs and starts what tests/cluster needs on Debian, as root. Idempotent; about a second
# when everything is already installed and running.
#   - PostgreSQL on 127.0.0.1:5432 (user postgres, trust auth): started if installed, installed
#     and set to trust local TCP connections only if missing;
#   - Slurm: slurmctld and four slurmd (node1..node4, all on localhost, ports 17001-17004,
#     AuthType=auth/none, zones zone1 = node1-2, zone2 = node3-4) from /etc/slurm/slurm.conf;
#   - chromium and chromium-driver (headless dashboard test).
set -euo pipefail

if [ "$(id -u)" != 0 ]; then
    echo "services.sh: must run as root (apt-get, daemons)" >&2
    exit 1
fi

need=()
command -v slurmctld >/dev/null || need+=(slurmctld slurmd slurm-client)
command -v chromium >/dev/null || need+=(chromium)
command -v chromedriver >/dev/null || need+=(chromium-driver)
fresh_pg=0
if ! ls /etc/postgresql/*/main >/dev/null 2>&1; then
    need+=(postgresql)
    fresh_pg=1
fi
if [ ${#need[@]} -gt 0 ]; then
    echo "services.sh: installing ${need[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# -- PostgreSQL ----------------------------------------------------------------------------------
pg_version=$(ls /etc/postgresql | sort -V | tail -n 1)
if [ "$fresh_pg" = 1 ]; then
    hba=/etc/postgresql/$pg_version/main/pg_hba.conf
    sed -i '1i host all all 127.0.0.1/32 trust\nlocal all all trust' "$hba"
fi
if ! pg_isready -q -h 127.0.0.1 -p 5432; then
    pg_ctlcluster --skip-systemctl-redirect "$pg_version" main start
fi

# -- Slurm ---------------------------------------------------------------------------------------
conf=$(cat <<'CONF'
# written by luban's .ci/services.sh: a 4-node Slurm cluster on localhost for tests/cluster
ClusterName=luban
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
SlurmctldPort=6817
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmctldPidFile=/run/slurm/slurmctld.pid
SlurmdPidFile=/run/slurm/slurmd-%n.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd-%n.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/linear
SchedulerType=sched/builtin
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MinJobAge=3600
KillWait=5
SlurmdTimeout=30
NodeName=node1 NodeHostname=localhost NodeAddr=127.0.0.1 Port=17001 CPUs=1 Feature=zone1 State=UNKNOWN
NodeName=node2 NodeHostname=localhost NodeAddr=127.0.0.1 Port=17002 CPUs=1 Feature=zone1 State=UNKNOWN
NodeName=node3 NodeHostname=localhost NodeAddr=127.0.0.1 Port=17003 CPUs=1 Feature=zone2 State=UNKNOWN
NodeName=node4 NodeHostname=localhost NodeAddr=127.0.0.1 Port=17004 CPUs=1 Feature=zone2 State=UNKNOWN
PartitionName=debug Nodes=node[1-4] Default=YES MaxTime=INFINITE State=UP OverSubscribe=EXCLUSIVE
CONF
)
mkdir -p /etc/slurm /var/spool/slurmctld /var/log/slurm /run/slurm
nodes="node1 node2 node3 node4"
alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
if [ "$(cat /etc/slurm/slurm.conf 2>/dev/null)" != "$conf" ]; then
    for pidfile in /run/slurm/slurmctld.pid /run/slurm/slurmd-*.pid; do
        if alive "$pidfile"; then kill "$(cat "$pidfile")"; fi
    done
    sleep 1
    printf '%s\n' "$conf" > /etc/slurm/slurm.conf
fi
alive /run/slurm/slurmctld.pid || slurmctld
for n in $nodes; do
    mkdir -p "/var/spool/slurmd/$n"
    alive "/run/slurm/slurmd-$n.pid" || slurmd -N "$n"
done
for _ in $(seq 60); do
    states=$(sinfo -h -N -o '%N %t' 2>/dev/null || true)
    if echo "$states" | grep -qE 'down|drain'; then
        scontrol update nodename=node[1-4] state=resume 2>/dev/null || true
    fi
    if [ "$(echo "$states" | grep -cE ' (idle|alloc|mix)')" -ge 4 ]; then
        echo "services.sh: PostgreSQL, Slurm (4 nodes), chromium ready"
        exit 0
    fi
    sleep 0.5
done
echo "services.sh: Slurm nodes did not come up:" >&2
sinfo -N >&2 || true
exit 1
