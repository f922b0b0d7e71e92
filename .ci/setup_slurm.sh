#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for testing submit_pm.sh for real (tests/test_slurm.py).
#
#   sudo .ci/setup_slurm.sh         # install (Debian/Ubuntu), configure, start; waits until the node is idle
#   sudo .ci/setup_slurm.sh stop    # stop slurmd, slurmctld and munged
#
# Safe to run twice: packages are installed only when missing, running daemons are left alone, and
# the config is rewritten only if it is ours. No cgroups (containers rarely allow them): processes
# are tracked through /proc (proctrack/linuxproc) and tasks are not bound (task/none).
# No accounting daemon either, so `sacct` does not work here: poll `scontrol show job` instead
# (finished jobs stay visible for MinJobAge seconds).
set -euo pipefail

CONF=/etc/slurm/slurm.conf
MARKER="# written by .ci/setup_slurm.sh"
SPOOL=/var/spool/slurm-ci
LOGS=/var/log/slurm-ci
NODE=$(hostname -s)

die() { echo "setup_slurm.sh: $*" >&2; exit 1; }

# Daemons are reparented to PID 1, which in some containers never reaps them: a zombie counts as gone.
alive() { local stat; stat=$(ps -o stat= -p "$1" 2>/dev/null) && [[ $stat != Z* ]]; }
running() { [[ -s $1 ]] && alive "$(<"$1")"; }

stop_daemons() {
    # Each daemon writes its pid file; stop exactly those processes.
    local pidfile pid
    for pidfile in /run/slurmd-ci.pid /run/slurmctld-ci.pid /run/munge/munged-ci.pid; do
        [[ -s $pidfile ]] || continue
        pid=$(<"$pidfile")
        if alive "$pid" && kill "$pid"; then
            for _ in $(seq 100); do alive "$pid" || break; sleep 0.1; done
        fi
        rm -f "$pidfile"
    done
}

if [[ ${1:-start} == stop ]]; then
    [[ $EUID -eq 0 ]] || die "run as root to stop the daemons"
    stop_daemons
    exit 0
fi
[[ ${1:-start} == start ]] || die "unknown subcommand '$1'; use: $0 [start|stop]"
[[ $EUID -eq 0 ]] || die "must run as root (installs packages and starts system daemons)"

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
        || ! command -v munged >/dev/null; then
    command -v apt-get >/dev/null || die "slurm is not installed and apt-get is not available to install it"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null
fi

# --- munge: the authentication every Slurm message carries ---------------------------------------
if [[ ! -s /etc/munge/munge.key ]]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown munge:munge /etc/munge/munge.key
chmod 400 /etc/munge/munge.key
install -d -o munge -g munge -m 755 /run/munge
install -d -o munge -g munge -m 700 /var/lib/munge /var/log/munge
if ! munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
    runuser -u munge -- munged --force --pid-file=/run/munge/munged-ci.pid
    for _ in $(seq 50); do munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
    munge -n </dev/null | unmunge >/dev/null || die "munged did not start; see /var/log/munge/munged.log"
fi

# --- slurm.conf: one node (this machine), one partition ---------------------------------------------
if [[ -e $CONF ]] && ! grep -qF "$MARKER" "$CONF"; then
    die "$CONF exists and was not written by this script; refusing to overwrite a real cluster's config"
fi
install -d -m 755 "$SPOOL/ctld" "$SPOOL/d" "$LOGS"
# The node's cores as slurmd finds them. GNU nproc honours OMP_NUM_THREADS, which a test runner or a login shell
# may set to 1: a 1-CPU node would leave every 2-task job pending forever (reason PartitionConfig).
CPUS=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
cat >"$CONF" <<EOF
$MARKER
ClusterName=ci
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmctldPidFile=/run/slurmctld-ci.pid
SlurmdPidFile=/run/slurmd-ci.pid
StateSaveLocation=$SPOOL/ctld
SlurmdSpoolDir=$SPOOL/d
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
AuthType=auth/munge
# A requeued job waits cred_expire seconds before it may start again (its old credential must
# expire first; starting it earlier fails with "Job credential revoked"). 120 s by default.
AuthInfo=cred_expire=10
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
MinJobAge=3600
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF

# --- daemons -----------------------------------------------------------------------------------
if running /run/slurmctld-ci.pid; then
    scontrol reconfigure
else
    slurmctld
fi
running /run/slurmd-ci.pid || slurmd

for _ in $(seq 60); do
    state=$(sinfo -h -N -n "$NODE" -o %T 2>/dev/null || true)
    case $state in
        idle|mixed|allocated) echo "slurm is up: node $NODE is $state"; exit 0 ;;
        down*|drain*) scontrol update NodeName="$NODE" State=RESUME 2>/dev/null || true ;;
    esac
    sleep 0.5
done
die "node $NODE did not become idle in 30 s (state: '${state:-none}'); see $LOGS/slurmctld.log and $LOGS/slurmd.log"
