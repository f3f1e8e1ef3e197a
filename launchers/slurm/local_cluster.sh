#!/usr/bin/env bash
# A real SLURM cluster on one host: munge, slurmctld and N slurmd "nodes" on 127.0.0.1.
#
#   launchers/slurm/local_cluster.sh install   # Debian packages (idempotent; seconds when present)
#   eval "$(launchers/slurm/local_cluster.sh start)"   # install if needed, start munged, slurmctld,
#                                               # slurmd x N; exports SWBERT_SLURM_DIR and SLURM_CONF
#   launchers/slurm/local_cluster.sh status
#   launchers/slurm/local_cluster.sh stop      # cancel jobs, stop the daemons by pid
#
# It exists to run the sbatch scripts of this folder against real daemons (the test suite does),
# and to try them on a workstation before a cluster. Everything it writes lives in one private
# state folder; it touches no system configuration and starts no system service.
#
# Settings (environment):
#   SWBERT_SLURM_DIR        state folder (config, munge key and socket, logs, pid files): `start`
#                           creates a new one with mktemp when unset and prints it; the other
#                           commands need it. An existing folder must be yours and writable by
#                           nobody else. Mode 0711: only root lists or creates entries in it;
#                           others may only pass through to the munge socket and slurm.conf
#                           (munged runs as the munge user, jobs as their users); logs, state
#                           and pid files are 0700.
#   SWBERT_SLURM_NODES      number of slurmd "nodes" n1..nN [2]
#   SWBERT_SLURM_CTLD_PORT  slurmctld port [16817]; node i listens on SWBERT_SLURM_NODE_PORT + i - 1
#   SWBERT_SLURM_NODE_PORT  [17001]
#
# Needs root (slurmd runs jobs as their user; munged runs as the munge user) and apt for install.
set -euo pipefail

DIR=${SWBERT_SLURM_DIR:-}
NODES=${SWBERT_SLURM_NODES:-2}
CTLD_PORT=${SWBERT_SLURM_CTLD_PORT:-16817}
NODE_PORT=${SWBERT_SLURM_NODE_PORT:-17001}
CONF=$DIR/slurm.conf
PACKAGES=(slurmctld slurmd slurm-client munge)

die() {
    echo "local_cluster: $*" >&2
    exit 1
}
log() { echo "local_cluster: $*" >&2; }

node_names() { seq -f "n%g" 1 "$NODES"; }

pid_alive() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

require_root() {
    [[ $(id -u) == 0 ]] || die "must run as root (slurmd and munged need it); you are $(id -un)"
}

cmd_install() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null &&
        command -v munged >/dev/null; then
        return 0
    fi
    require_root
    command -v apt-get >/dev/null || die "apt-get not found: install ${PACKAGES[*]} with your package manager"
    log "installing ${PACKAGES[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null || die "apt-get update failed"
    # The packages' own services are not used (and do not start without systemd).
    apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null ||
        die "apt-get install ${PACKAGES[*]} failed"
}

# The host's CPU layout as slurmd detects it (CPUs, boards, sockets, cores, threads per core). Every
# node declares it: tasks are bound to CPUs (task/affinity), and a layout that is not the host's
# would bind them to CPUs that do not exist or drain the node.
cpu_layout() {
    local layout
    layout=$(slurmd -C 2>/dev/null | head -n1 | tr ' ' '\n' |
        grep -E '^(CPUs|Boards|SocketsPerBoard|CoresPerSocket|ThreadsPerCore)=' | tr '\n' ' ' || true)
    echo "${layout:-CPUs=$(nproc) }"
}

write_config() {
    local node_list="n[1-$NODES]" last_port=$((NODE_PORT + NODES - 1)) mem_mb layout
    layout=$(cpu_layout)
    ((NODES == 1)) && node_list=n1
    # Advertise memory below the host's, split between the nodes, so slurmd accepts the config.
    mem_mb=$(($(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo) / (NODES + 1)))
    cat >"$CONF" <<CONF
# Written by launchers/slurm/local_cluster.sh: a one-host cluster, nodes n1..n$NODES on 127.0.0.1.
ClusterName=swbert-local
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: a requeued job may start again after this many seconds (default 120).
AuthInfo=socket=$DIR/munge/munge.socket,cred_expire=10
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/pids/slurmctld.pid
SlurmdPidFile=$DIR/pids/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# Processes are tracked through /proc. Each task is bound to the cores its step was given
# (sched_setaffinity), as on clusters that bind: a step that asks for no CPUs gets one core per
# task. task/cgroup would bind too, but needs the host's cgroup hierarchy, left alone here.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
TaskPluginParam=Cores
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=1
KillWait=30
# Accounting without slurmdbd: finished jobs and their exit states go to a text file (sacct -c).
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/jobcomp.txt
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName=$node_list NodeAddr=127.0.0.1 Port=$NODE_PORT-$last_port ${layout}RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$node_list Default=YES MaxTime=INFINITE State=UP
CONF
    ((NODES == 1)) && sed -i "s/Port=$NODE_PORT-$last_port/Port=$NODE_PORT/" "$CONF"
    return 0
}

start_munge() {
    local key=$DIR/munge/munge.key
    if pid_alive "$DIR/munge/munged.pid"; then return 0; fi
    mkdir -p "$DIR/munge"
    if [[ ! -s $key ]]; then
        dd if=/dev/urandom of="$key" bs=1 count=1024 status=none
    fi
    chown -R munge:munge "$DIR/munge"
    chmod 0755 "$DIR/munge"  # clients need to reach the socket
    chmod 0400 "$key"
    runuser -u munge -- munged --socket="$DIR/munge/munge.socket" --key-file="$key" \
        --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/munge/munged.log" \
        --seed-file="$DIR/munge/munged.seed" ||
        die "munged did not start; see $DIR/munge/munged.log"
    # munged writes its pid file when ready.
    for _ in $(seq 50); do
        pid_alive "$DIR/munge/munged.pid" && return 0
        sleep 0.1
    done
    die "munged did not write its pid file; see $DIR/munge/munged.log"
}

# The state folder: a new private one from mktemp for `start` when SWBERT_SLURM_DIR is unset (never
# a fixed, guessable path in /tmp, where another user could plant a folder or a link that root then
# writes through); an existing one only if it is a real folder of ours that nobody else can write.
state_folder() {
    if [[ -z $DIR ]]; then
        [[ $1 == start ]] || die "SWBERT_SLURM_DIR is not set: set it to the folder 'start' printed (eval \"\$($0 start)\" sets it)"
        DIR=$(mktemp -d "${TMPDIR:-/tmp}/swbert-slurm.XXXXXXXX") || die "mktemp -d failed"
        CONF=$DIR/slurm.conf
        return 0
    fi
    [[ $DIR == /* ]] || die "SWBERT_SLURM_DIR=$DIR must be an absolute path"
    if [[ $1 == start && ! -e $DIR ]]; then
        mkdir -m 0700 "$DIR" || die "cannot create SWBERT_SLURM_DIR=$DIR"
    fi
    [[ -d $DIR && ! -L $DIR ]] || die "SWBERT_SLURM_DIR=$DIR is not a folder (or is a symbolic link)"
    [[ -O $DIR ]] || die "SWBERT_SLURM_DIR=$DIR belongs to another user; use a folder of your own"
    ((8#$(stat -c '%a' "$DIR") & 8#022)) && die "SWBERT_SLURM_DIR=$DIR is writable by others; use a private folder (mktemp -d)"
    return 0
}

cmd_start() {
    require_root
    cmd_install
    mkdir -p "$DIR"/{ctld,spool,pids,log}
    chmod 0711 "$DIR"
    chmod 0700 "$DIR"/{ctld,pids,log}
    chmod 0711 "$DIR/spool" # slurmd keeps each job's script in it, run as the job's user
    if ! pid_alive "$DIR/pids/slurmctld.pid"; then
        write_config
    fi
    start_munge
    if ! pid_alive "$DIR/pids/slurmctld.pid"; then
        # -c: start from a clean state (no jobs from an earlier run).
        slurmctld -c -f "$CONF" || die "slurmctld did not start; see $DIR/log/slurmctld.log"
    fi
    local node
    for node in $(node_names); do
        if ! pid_alive "$DIR/pids/slurmd-$node.pid"; then
            mkdir -p "$DIR/spool/$node"
            slurmd -f "$CONF" -N "$node" || die "slurmd -N $node did not start; see $DIR/log/slurmd-$node.log"
        fi
    done
    wait_idle
    log "up: $NODES node(s) x $(sed -n 's/^NodeName=.* CPUs=\([0-9]*\) .*/\1/p' "$CONF") CPU(s) in $DIR"
    cmd_env
}

cmd_env() { echo "export SWBERT_SLURM_DIR=$DIR SLURM_CONF=$CONF"; }

wait_idle() {
    export SLURM_CONF=$CONF
    local states=""
    for _ in $(seq 150); do
        states=$(sinfo -h -N -o "%N %T" 2>/dev/null || true)
        if [[ -n $states ]] && ! grep -qvE " (idle|mixed|allocated)$" <<<"$states"; then
            return 0
        fi
        sleep 0.2
    done
    die "nodes not idle after 30 s: ${states:-slurmctld not answering}; see $DIR/log/"
}

stop_pidfile() {
    local file=$1 pid
    pid_alive "$file" || {
        rm -f "$file"
        return 0
    }
    pid=$(cat "$file")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 100); do
        kill -0 "$pid" 2>/dev/null || {
            rm -f "$file"
            return 0
        }
        sleep 0.1
    done
    log "pid $pid ($file) did not stop in 10 s; sending SIGKILL"
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$file"
}

cmd_stop() {
    export SLURM_CONF=$CONF
    if pid_alive "$DIR/pids/slurmctld.pid"; then
        # Cancel what still runs so no job step outlives the daemons.
        scancel --full --quiet --user="$(id -un)" 2>/dev/null || true
        for _ in $(seq 100); do
            [[ -z $(squeue -h -t R,CG,PD 2>/dev/null) ]] && break
            sleep 0.2
        done
    fi
    local file
    for file in "$DIR"/pids/slurmd-*.pid; do
        [[ -e $file ]] && stop_pidfile "$file"
    done
    stop_pidfile "$DIR/pids/slurmctld.pid"
    stop_pidfile "$DIR/munge/munged.pid"
    log "stopped"
}

cmd_status() {
    local file ok=0
    for file in "$DIR/munge/munged.pid" "$DIR"/pids/*.pid; do
        [[ -e $file ]] || continue
        if pid_alive "$file"; then
            echo "$(basename "$file" .pid): running (pid $(cat "$file"))"
        else
            echo "$(basename "$file" .pid): not running"
            ok=1
        fi
    done
    if pid_alive "$DIR/pids/slurmctld.pid"; then
        SLURM_CONF=$CONF sinfo -N -o "%N %T %c"
    else
        echo "slurmctld: not running"
        ok=1
    fi
    return $ok
}

case ${1:-} in
install) cmd_install ;;
start) state_folder start && cmd_start ;;
stop) state_folder stop && cmd_stop ;;
status) state_folder status && cmd_status ;;
env) state_folder env && cmd_env ;;
*)
    echo "usage: $0 install|start|stop|status|env" >&2
    exit 2
    ;;
esac
