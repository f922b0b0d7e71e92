#!/usr/bin/env bash
# A two-node Slurm cluster on this one machine, for testing multi-node submit_pm.sh runs for real
# (tests/test_slurm_two_nodes.py).
#
#   sudo .ci/setup_slurm_two_nodes.sh          # configure and start; waits until both nodes are idle
#   sudo .ci/setup_slurm_two_nodes.sh stop     # stop everything and remove every trace
#   export SLURM_CONF=/run/slurm-ci2n/slurm.conf
#   sudo nsenter --net=/run/netns/ci2n-ctl sbatch -N 2 ...   # clients talk to the controller from there
#
# Three network namespaces, each with its own hostname (UTS namespace) and address:
#   ci2n-ctl    10.231.0.1   slurmctld; holds the bridge br0 that joins the three
#   ci2n-node1  10.231.0.11  slurmd "node1"  (veth eth0 <-> v1 on br0)
#   ci2n-node2  10.231.0.12  slurmd "node2"  (veth eth0 <-> v2 on br0)
# No namespace has a default route and the root namespace has no interface on the bridge, so
# traffic stays between these three. Host names resolve through a private hosts file bind-mounted
# over /etc/hosts in each namespace's own mount namespace (the real one is untouched), and a
# private munged (own key and socket, a file-system socket reaches every network namespace)
# authenticates. Nothing is shared with .ci/setup_slurm.sh's one-node cluster: own config (through
# SLURM_CONF), ports, spool, pid and log files, all under $BASE, which `stop` deletes.
#
# Daemons start through `nsenter --net=... unshare --uts --mount`, not `ip netns exec`: the latter
# remounts /sys, which hides /sys/fs/cgroup, and slurmd then stops with "slurmd initialization
# failed". Set-up lessons of the one-node cluster apply: proctrack/linuxproc and task/none (no
# cgroups in containers), ReturnToService=2, cred_expire=10 (a requeued job restarts ~20 s later).
set -euo pipefail

BASE=/run/slurm-ci2n
CONF=$BASE/slurm.conf
SUBNET=10.231.0
CTL_NS=ci2n-ctl
NODES=(node1 node2)
CTLD_PORT=6917   # the one-node cluster keeps Slurm's defaults, 6817 and 6818
SLURMD_PORT=6918

die() { echo "setup_slurm_two_nodes.sh: $*" >&2; exit 1; }
# Exit code 77: this machine cannot host the cluster (not root, no packages, no namespaces); the test skips.
cannot() { echo "setup_slurm_two_nodes.sh: $*" >&2; exit 77; }

# A daemon reparented to PID 1 may never be reaped there: a zombie counts as gone.
alive() { local stat; stat=$(ps -o stat= -p "$1" 2>/dev/null) && [[ $stat != Z* ]]; }

namespaces() { echo "$CTL_NS"; for node in "${NODES[@]}"; do echo "ci2n-$node"; done; }

# A Slurm client command, run where the controller can be reached.
client() { SLURM_CONF=$CONF nsenter --net="/run/netns/$CTL_NS" "$@"; }

any_alive() { local pid; for pid; do alive "$pid" && return 0; done; return 1; }

kill_and_wait() {  # kill_and_wait SIGNAL SECONDS PID...: signal exactly these processes, wait for them
    local signal=$1 seconds=$2
    shift 2
    (( $# )) || return 0
    kill "-$signal" "$@" 2>/dev/null || true
    for _ in $(seq $((seconds * 10))); do any_alive "$@" || return 0; sleep 0.1; done
}

namespace_pids() {  # every process in our network namespaces
    local ns
    for ns in $(namespaces); do
        [[ -e /run/netns/$ns ]] && ip netns pids "$ns" 2>/dev/null || true
    done
}

stop_all() {
    local ns jobs
    # Jobs first, so that slurmd can end their steps cleanly.
    if [[ -s $BASE/ctl.pid ]] && alive "$(<"$BASE/ctl.pid")"; then
        jobs=$(client timeout 10 squeue -h -o %A 2>/dev/null || true)
        # shellcheck disable=SC2086
        [[ -z $jobs ]] || client timeout 10 scancel --full $jobs 2>/dev/null || true
    fi
    # Every process in our namespaces was started by this script or by the daemons it started:
    # slurmctld, the slurmds, their slurmstepds and the jobs' tasks. With a job running, slurmd and
    # slurmstepd outlive a SIGTERM by more than 3 s (seen here); then SIGKILL.
    # shellcheck disable=SC2046
    kill_and_wait TERM 3 $(namespace_pids)
    # shellcheck disable=SC2046
    kill_and_wait KILL 10 $(namespace_pids)
    if [[ -s $BASE/munge/munged.pid ]] && alive "$(<"$BASE/munge/munged.pid")"; then
        kill_and_wait TERM 10 "$(<"$BASE/munge/munged.pid")"
    fi
    # Deleting the controller's namespace deletes the bridge and the veth pairs with it.
    for ns in $(namespaces); do
        [[ -e /run/netns/$ns ]] && ip netns delete "$ns"
    done
    # The first `ip netns add` makes /run/netns and bind-mounts it on itself; undo that if it was us.
    if [[ -e $BASE/made-run-netns ]] && [[ -z $(ls -A /run/netns 2>/dev/null) ]]; then
        umount /run/netns 2>/dev/null || true
        rmdir /run/netns 2>/dev/null || true
    fi
    rm -rf "$BASE"
}

daemons_alive() {  # munged and the pid files start_in writes: ctl.pid, node1.pid, node2.pid
    local file
    for file in "$BASE/munge/munged.pid" "$BASE/ctl.pid" "${NODES[@]/%/.pid}"; do
        [[ $file == /* ]] || file=$BASE/$file
        [[ -s $file ]] && alive "$(<"$file")" || return 1
    done
}

wait_until_idle() {
    local node state all
    for _ in $(seq 120); do
        all=1
        for node in "${NODES[@]}"; do
            state=$(client sinfo -h -N -n "$node" -o %T 2>/dev/null || true)
            case $state in
                idle|mixed|allocated) ;;
                down*|drain*) all=0; client scontrol update NodeName="$node" State=RESUME 2>/dev/null || true ;;
                *) all=0 ;;
            esac
        done
        if (( all )); then
            echo "two-node slurm is up: ${NODES[*]} idle; SLURM_CONF=$CONF, clients run in namespace $CTL_NS"
            return 0
        fi
        sleep 0.5
    done
    die "nodes did not become idle in 60 s (last: $node '${state:-none}')"
}

case ${1:-start} in
    stop)
        [[ $EUID -eq 0 ]] || die "run as root to stop the daemons and delete the namespaces"
        stop_all
        exit 0 ;;
    start) ;;
    *) die "unknown subcommand '$1'; use: $0 [start|stop]" ;;
esac
[[ $EUID -eq 0 ]] || cannot "must run as root (creates network namespaces and starts system daemons)"
for tool in slurmctld slurmd sbatch munged ip nsenter unshare runuser; do
    command -v "$tool" >/dev/null && continue
    command -v apt-get >/dev/null || cannot "$tool not found and apt-get is not available to install it"
    apt-get update -qq || cannot "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge iproute2 util-linux \
        >/dev/null || cannot "could not install Slurm, munge and iproute2"
    break
done

if daemons_alive; then
    wait_until_idle
    exit 0
fi
stop_all  # leftovers of an interrupted run, if any

# When a later step fails: show the daemons' logs (they go with the rest), then remove everything.
on_failure() {
    local log
    for log in "$BASE"/log/* "$BASE/munge/munged.log"; do
        [[ -s $log ]] && { echo "--- $log" >&2; tail -n 20 "$log" >&2; }
    done
    echo "setup_slurm_two_nodes.sh: set-up failed; everything it made is removed again" >&2
    stop_all
}
trap 'status=$?; if (( status )); then on_failure; fi' EXIT

# --- files: config, hosts, munge key ---------------------------------------------------------------
install -d -m 755 "$BASE" "$BASE/ctld" "$BASE/log"
for node in "${NODES[@]}"; do install -d -m 755 "$BASE/spool/$node"; done
{
    echo "127.0.0.1 localhost"
    echo "$SUBNET.1 ctl"
    i=10
    for node in "${NODES[@]}"; do i=$((i + 1)); echo "$SUBNET.$i $node"; done
} >"$BASE/hosts"

install -d -o munge -g munge -m 755 "$BASE/munge"  # clients need to reach the socket
dd if=/dev/urandom of="$BASE/munge/munge.key" bs=1024 count=1 status=none
chown munge:munge "$BASE/munge/munge.key"
chmod 400 "$BASE/munge/munge.key"

node_lines=""
i=10
for node in "${NODES[@]}"; do
    i=$((i + 1))
    node_lines+="NodeName=$node NodeHostname=$node NodeAddr=$SUBNET.$i CPUs=1 State=UNKNOWN"$'\n'
done
cat >"$CONF" <<EOF
# written by .ci/setup_slurm_two_nodes.sh
ClusterName=ci2n
SlurmctldHost=ctl($SUBNET.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmctldPidFile=$BASE/slurmctld.pid
SlurmdPidFile=$BASE/slurmd-%n.pid
StateSaveLocation=$BASE/ctld
SlurmdSpoolDir=$BASE/spool/%n
SlurmctldLogFile=$BASE/log/slurmctld.log
SlurmdLogFile=$BASE/log/slurmd-%n.log
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$BASE/munge/munge.socket,cred_expire=10
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
${node_lines}PartitionName=debug Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP
EOF

# --- network: three namespaces on one bridge, no route out --------------------------------------------
[[ -d /run/netns ]] || touch "$BASE/made-run-netns"
ip netns add "$CTL_NS" || cannot "cannot create network namespaces here (ip netns add failed)"
ip -n "$CTL_NS" link set lo up
ip -n "$CTL_NS" link add br0 type bridge
ip -n "$CTL_NS" addr add "$SUBNET.1/24" dev br0
ip -n "$CTL_NS" link set br0 up
i=10
for node in "${NODES[@]}"; do
    i=$((i + 1))
    ip netns add "ci2n-$node"
    ip -n "$CTL_NS" link add "v${node#node}" type veth peer name eth0 netns "ci2n-$node"
    ip -n "$CTL_NS" link set "v${node#node}" master br0 up
    ip -n "ci2n-$node" link set lo up
    ip -n "ci2n-$node" addr add "$SUBNET.$i/24" dev eth0
    ip -n "ci2n-$node" link set eth0 up
done

# --- daemons ---------------------------------------------------------------------------------------
runuser -u munge -- munged --socket="$BASE/munge/munge.socket" --key-file="$BASE/munge/munge.key" \
    --pid-file="$BASE/munge/munged.pid" --log-file="$BASE/munge/munged.log" --seed-file="$BASE/munge/munged.seed"
for _ in $(seq 50); do
    munge -S "$BASE/munge/munge.socket" -n </dev/null 2>/dev/null \
        | unmunge -S "$BASE/munge/munge.socket" >/dev/null 2>&1 && break
    sleep 0.1
done
munge -S "$BASE/munge/munge.socket" -n </dev/null | unmunge -S "$BASE/munge/munge.socket" >/dev/null \
    || die "munged did not start"

# start_in NAMESPACE HOSTNAME COMMAND...: a daemon in the foreground (-D) in the namespace's network,
# with its own hostname and the private hosts file. The shell writes its PID to $BASE/HOSTNAME.pid,
# then execs the daemon, which keeps that PID.
start_in() {
    local ns=$1 host=$2
    shift 2
    # shellcheck disable=SC2016  # the inner shell expands these
    SLURM_CONF=$CONF setsid nsenter --net="/run/netns/$ns" unshare --uts --mount \
        sh -c 'echo $$ >"$0/$1.pid" && mount --bind "$0/hosts" /etc/hosts && hostname "$1" && shift && exec "$@"' \
        "$BASE" "$host" "$@" </dev/null >>"$BASE/log/$host.stdout" 2>&1 &
}
start_in "$CTL_NS" ctl slurmctld -D
for node in "${NODES[@]}"; do
    start_in "ci2n-$node" "$node" slurmd -D -N "$node"
done

for _ in $(seq 100); do daemons_alive && break; sleep 0.1; done
daemons_alive || die "a daemon did not start"
wait_until_idle
trap - EXIT
