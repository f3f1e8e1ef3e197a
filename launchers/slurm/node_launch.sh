#!/usr/bin/env bash
# One launcher per node: waits for the rendezvous, then starts this node's training processes.
#
#   node_launch.sh SCRIPT [ARGS...]
#
# Run by the sbatch scripts as one `srun` task per node, or by hand for several "nodes" on one
# machine (each with its own NODE_RANK). Settings (environment):
#   NNODES, NODE_RANK        nodes in the job and this node's rank [SLURM_JOB_NUM_NODES, SLURM_NODEID]
#   NPROC_PER_NODE           processes (GPUs) on this node [1]
#   MASTER_ADDR, MASTER_PORT the rendezvous, hosted by node 0 (required)
#   RDZV_ID                  rendezvous id, the same on every node [SLURM_JOB_ID or "swbert"]
#   RDZV_TIMEOUT             seconds to reach the rendezvous and for all nodes to join [300]
#   SWBERT_LAUNCHER          torchrun (c10d rendezvous) | deepspeed (deepspeed --no_ssh) [torchrun]
#
# Pre-emption: this node's launcher ignores SIGUSR1 so that the signal, sent by `srun`/`scancel` to
# every process of the step, is handled by the training processes only (they checkpoint and exit 75).
# torchrun and the deepspeed launcher would otherwise die of it and take their workers with them.
set -euo pipefail

die() {
    echo "node_launch (node ${NODE_RANK:-?}): $*" >&2
    exit 1
}

[[ $# -ge 1 ]] || die "usage: node_launch.sh SCRIPT [ARGS...]"
NNODES=${NNODES:-${SLURM_JOB_NUM_NODES:-1}}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
NPROC_PER_NODE=${NPROC_PER_NODE:-1}
RDZV_ID=${RDZV_ID:-${SLURM_JOB_ID:-swbert}}
RDZV_TIMEOUT=${RDZV_TIMEOUT:-300}
LAUNCHER=${SWBERT_LAUNCHER:-torchrun}
[[ -n ${MASTER_ADDR:-} && -n ${MASTER_PORT:-} ]] || die "MASTER_ADDR and MASTER_PORT must be set (node 0's address and a free port)"
((NODE_RANK >= 0 && NODE_RANK < NNODES)) || die "NODE_RANK=$NODE_RANK is outside 0..$((NNODES - 1)) (NNODES=$NNODES)"
[[ -f $1 ]] || die "training script $1 not found (run from the repository root)"

# Node 0 hosts the rendezvous store; the others wait until it accepts connections, so a wrong or
# unreachable address fails here, within RDZV_TIMEOUT, with a message naming it.
if ((NODE_RANK != 0)); then
    deadline=$((SECONDS + RDZV_TIMEOUT))
    until timeout 2 bash -c "exec 3<>/dev/tcp/$MASTER_ADDR/$MASTER_PORT" 2>/dev/null; do
        ((SECONDS < deadline)) || die "rendezvous $MASTER_ADDR:$MASTER_PORT not reachable after ${RDZV_TIMEOUT}s" \
            "(node 0 not started, wrong MASTER_ADDR/MASTER_PORT, or a firewall); raise RDZV_TIMEOUT if node 0 starts late"
        sleep 1
    done
fi

trap '' USR1
echo "node_launch: node $NODE_RANK/$NNODES on $(hostname), $NPROC_PER_NODE process(es), rendezvous $MASTER_ADDR:$MASTER_PORT ($LAUNCHER)"
[[ $LAUNCHER != torchrun && $LAUNCHER != deepspeed ]] || command -v "$LAUNCHER" >/dev/null ||
    die "$LAUNCHER not found on PATH; activate the environment swbert is installed in (e.g. source .venv/bin/activate)"
case $LAUNCHER in
torchrun)
    cmd=(torchrun --nnodes="$NNODES" --nproc-per-node="$NPROC_PER_NODE" --max-restarts=0
        --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$RDZV_ID"
        --rdzv-conf="is_host=$((NODE_RANK == 0 ? 1 : 0)),join_timeout=$RDZV_TIMEOUT,read_timeout=$RDZV_TIMEOUT"
        "$@")
    ;;
deepspeed)
    # The deepspeed launcher learns the world from a hostfile: one line per node, none contacted.
    hostfile=$(mktemp)
    for ((i = 0; i < NNODES; i++)); do echo "node$i slots=$NPROC_PER_NODE"; done >"$hostfile"
    cmd=(deepspeed --no_ssh --hostfile="$hostfile" --node_rank="$NODE_RANK"
        --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" "$@")
    ;;
*) die "SWBERT_LAUNCHER=$LAUNCHER is not one of torchrun, deepspeed" ;;
esac

# Keep a copy of stderr to turn a rendezvous failure into one line that names the rendezvous.
errors=$(mktemp)
trap 'rm -f "$errors" "${hostfile:-}"' EXIT
rc=0
"${cmd[@]}" 2> >(tee "$errors" >&2) || rc=$?
wait # for tee
if ((rc != 0)) && grep -qE "Rendezvous(Timeout|Connection|Closed)Error" "$errors"; then
    die "rendezvous $MASTER_ADDR:$MASTER_PORT (id $RDZV_ID): not all $NNODES node(s) joined within" \
        "RDZV_TIMEOUT=${RDZV_TIMEOUT}s; check that every node started and that MASTER_ADDR/MASTER_PORT are right"
fi
exit "$rc"
