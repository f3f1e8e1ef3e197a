# shellcheck shell=bash
# Shared body of the sbatch scripts in this folder: sourced, then `swbert_job ENTRY_POINT ARGS...`.
#
# It checks the allocation against the request, picks the master address from the allocation,
# exports the distributed and NCCL settings, starts one launcher per node (or one task per GPU)
# with `srun`, asking for the allocation's CPUs, and handles pre-emption: on SIGUSR1 (sent by
# SLURM before the time limit with `#SBATCH --signal=B:USR1@...`, or by
# `scancel --signal=USR1 --batch JOBID`) the training processes checkpoint and exit, and the job
# requeues itself; the next run continues with `--resume auto`. Restarts SLURM makes after a failure (a node lost, with --requeue) are bounded by
# SWBERT_MAX_RESTARTS. See launchers/slurm/README.md for the settings.

swbert_die() {
    echo "swbert-slurm: error: $*" >&2
    exit 2
}

swbert_log() { echo "swbert-slurm: $(date '+%F %T') $*"; }

# Value of --KEY in an argument list (last one wins, as argparse does); empty when absent.
swbert_arg() {
    local key=$1 value="" prev=""
    shift
    for arg in "$@"; do
        if [[ $prev == "--$key" || $prev == "--${key//-/_}" ]]; then
            value=$arg
        fi
        case $arg in
        --"$key"=* | --"${key//-/_}"=*) value=${arg#*=} ;;
        esac
        prev=$arg
    done
    echo "$value"
}

# Address of a node as SLURM knows it (NodeAddr), falling back to its name.
swbert_node_addr() {
    local addr
    addr=$(scontrol show node "$1" 2>/dev/null | tr ' ' '\n' | sed -n 's/^NodeAddr=//p' | head -n1)
    echo "${addr:-$1}"
}

# CPUs the allocation holds on its smallest node: SLURM_JOB_CPUS_PER_NODE reads like "72(x2),36".
swbert_node_cpus() {
    local min="" part count parts=()
    IFS=, read -r -a parts <<<"${SLURM_JOB_CPUS_PER_NODE:-}"
    for part in "${parts[@]}"; do
        count=${part%%(*}
        [[ $count =~ ^[0-9]+$ ]] || continue
        if [[ -z $min ]] || ((count < min)); then min=$count; fi
    done
    echo "${min:-${SLURM_CPUS_ON_NODE:-$(nproc)}}"
}

swbert_gpus_visible() {
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
    else
        echo 0
    fi
}

swbert_job() {
    local entry=$1
    shift
    [[ -n ${SLURM_JOB_ID:-} ]] || swbert_die "not inside a SLURM job: submit with sbatch (see launchers/slurm/README.md)"
    SWBERT_ROOT=${SWBERT_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
    cd "$SWBERT_ROOT" || swbert_die "SWBERT_ROOT=$SWBERT_ROOT is not a folder"
    [[ -f $entry ]] || swbert_die "$entry not found under $SWBERT_ROOT: submit from the repository root or set SWBERT_ROOT"
    local venv=${SWBERT_VENV:-$SWBERT_ROOT/.venv}
    if [[ -f $venv/bin/activate ]]; then
        # shellcheck disable=SC1091
        source "$venv/bin/activate"
    fi

    # Job arrays: `--sweep FILE` takes line SLURM_ARRAY_TASK_ID (blank lines and # comments skipped)
    # and appends its arguments to the command line.
    local args=() sweep="" tag=$SLURM_JOB_ID
    while (($#)); do
        case $1 in
        --sweep) sweep=${2:-}; shift 2 || swbert_die "--sweep needs a file" ;;
        --sweep=*) sweep=${1#*=}; shift ;;
        *) args+=("$1"); shift ;;
        esac
    done
    if [[ -n ${SLURM_ARRAY_TASK_ID:-} ]]; then
        tag=${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}
    fi
    if [[ -n $sweep ]]; then
        [[ -f $sweep ]] || swbert_die "sweep file $sweep not found (--sweep)"
        [[ -n ${SLURM_ARRAY_TASK_ID:-} ]] || swbert_die "--sweep needs a job array: sbatch --array=0-N ..."
        local line
        line=$(grep -v -e '^[[:space:]]*$' -e '^[[:space:]]*#' "$sweep" | sed -n "$((SLURM_ARRAY_TASK_ID + 1))p")
        [[ -n $line ]] || swbert_die "array task $SLURM_ARRAY_TASK_ID has no line in $sweep ($(grep -cv -e '^[[:space:]]*$' -e '^[[:space:]]*#' "$sweep") entries): use --array=0-$(($(grep -cv -e '^[[:space:]]*$' -e '^[[:space:]]*#' "$sweep") - 1))"
        local extra
        read -r -a extra <<<"$line"
        args+=("${extra[@]}")
    fi

    local recipe
    recipe=$(swbert_arg config "${args[@]}")
    if [[ -n $recipe && ! -f $recipe && ! -f swbert/recipes/$recipe.yaml ]]; then
        swbert_die "recipe $recipe not found (--config): neither a file under $SWBERT_ROOT nor a shipped" \
            "recipe ($(cd swbert/recipes 2>/dev/null && ls -- *.yaml 2>/dev/null | sed 's/\.yaml$//' | tr '\n' ' '))"
    fi

    # Nodes and processes: what the allocation holds, checked against what was asked for.
    local nnodes=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
    if [[ -n ${NNODES:-} && $NNODES != "$nnodes" ]]; then
        swbert_die "NNODES=$NNODES but the allocation has $nnodes node(s) ($SLURM_JOB_NODELIST): submit with sbatch --nodes=$NNODES, or unset NNODES"
    fi
    local visible launch_mode=${SWBERT_LAUNCHER:-torchrun}
    visible=$(swbert_gpus_visible)
    local per_node=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}
    if [[ $launch_mode == srun ]]; then
        # One task per GPU: the allocation's tasks per node are the processes per node.
        local tasks=${SLURM_NTASKS_PER_NODE:-$((SLURM_NTASKS / nnodes))}
        tasks=${tasks%%(*}
        per_node=${per_node:-$tasks}
        [[ $per_node == "$tasks" ]] || swbert_die "GPUS_PER_NODE=$per_node but the allocation has $tasks task(s) per node: with SWBERT_LAUNCHER=srun submit with --ntasks-per-node=$per_node"
    fi
    per_node=${per_node:-$((visible > 0 ? visible : 1))}
    [[ $per_node =~ ^[1-9][0-9]*$ ]] || swbert_die "GPUS_PER_NODE=$per_node is not a positive integer"
    if ((visible > 0 && per_node > visible)); then
        swbert_die "GPUS_PER_NODE=$per_node but $(hostname) has $visible GPU(s): submit with --gpus-per-node=$per_node on nodes that have them"
    fi
    if ((visible == 0)); then
        # CPU nodes: DeepSpeed's CPU accelerator and gloo; GPUS_PER_NODE counts processes.
        export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
    fi
    # CPUs of each task of the training step, asked for explicitly. Since Slurm 22.05 srun does not
    # take --cpus-per-task from the job (22.05 to 23.02.4 read only SRUN_CPUS_PER_TASK; later ones
    # read SLURM_CPUS_PER_TASK again, which only a job submitted with --cpus-per-task has), so a
    # step that does not ask gets one CPU per task, and where tasks are bound (task/affinity,
    # task/cgroup) a node's ranks and all their loader workers share one core. The per-node
    # launcher's one task gets all the node's CPUs (the smallest node's: one value holds for every
    # node); in srun mode each task gets the job's --cpus-per-task, or the node's CPUs split
    # between its tasks.
    local node_cpus task_cpus rank_cpus
    node_cpus=$(swbert_node_cpus)
    if [[ $launch_mode == srun ]]; then
        task_cpus=${SLURM_CPUS_PER_TASK:-$((node_cpus / per_node))}
        rank_cpus=$task_cpus
    else
        task_cpus=$node_cpus
        rank_cpus=$((node_cpus / per_node))
    fi
    ((task_cpus >= 1)) || task_cpus=1
    ((rank_cpus >= 1)) || rank_cpus=1
    # The trainer sizes its threads and loader workers from the CPUs its process is bound to;
    # OMP_NUM_THREADS is for everything else (and the fine-tuning launchers).
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$rank_cpus}

    # Rendezvous on the first node of the allocation, at the address SLURM reaches it by.
    local first
    first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
    export MASTER_ADDR=${MASTER_ADDR:-$(swbert_node_addr "$first")}
    # A port derived from the job id, so jobs sharing a node do not collide.
    export MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
    export NNODES=$nnodes NPROC_PER_NODE=$per_node RDZV_ID=swbert-$SLURM_JOB_ID
    export RDZV_TIMEOUT=${RDZV_TIMEOUT:-600}
    # Collective timeout (minutes) of the trainer's process groups: a hung collective fails then.
    export SWBERT_DIST_TIMEOUT_MIN=${SWBERT_DIST_TIMEOUT_MIN:-30}
    # NCCL: turn a timed-out collective into an error that ends the job instead of a hang.
    export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
    export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
    # NCCL's choice of network (docs/multinode.md, "Network interfaces"), when set: NCCL_SOCKET_IFNAME
    # (the IP interfaces: bootstrap, and the data without InfiniBand), NCCL_IB_HCA (the InfiniBand/RoCE
    # adapters). Set them in the environment you submit from, or in a copy of the sbatch script; they
    # are exported here (a plain assignment in the script reaches the ranks too), passed to every
    # task with the rest of this environment (the step runs with --export=ALL), and recorded in
    # job.txt. Unset, NCCL picks for itself.
    local nccl_net="" var
    for var in NCCL_SOCKET_IFNAME NCCL_IB_HCA; do
        if [[ -n ${!var:-} ]]; then
            export "${var?}"
            nccl_net+=" $var=${!var}"
        fi
    done

    # Per-job folders: logs of every node and every restart; outputs default to runs/JOBNAME-JOBID.
    local name=${SLURM_JOB_NAME:-swbert}
    local restart=${SLURM_RESTART_COUNT:-0}
    export SWBERT_LOG_DIR=${SWBERT_LOG_ROOT:-runs/slurm}/$name-$tag
    mkdir -p "$SWBERT_LOG_DIR"
    if [[ -z $(swbert_arg output-dir "${args[@]}") ]]; then
        args=(--output-dir "runs/$name-$tag" "${args[@]}")
    fi
    # Restarts SLURM made on its own (a node failure with --requeue, `scontrol requeue`), as opposed
    # to the requeues this script asks for after a pre-emption checkpoint (each marked by a
    # requeued-r<N> file in the log folder): a job that keeps failing stops after
    # SWBERT_MAX_RESTARTS of them instead of starting again and again.
    local max_restarts=${SWBERT_MAX_RESTARTS:-3} planned unplanned
    [[ $max_restarts =~ ^[0-9]+$ ]] || swbert_die "SWBERT_MAX_RESTARTS=$max_restarts is not a whole number (restarts after failures allowed, default 3)"
    planned=$(find "$SWBERT_LOG_DIR" -maxdepth 1 -name 'requeued-r*' | wc -l)
    unplanned=$((restart - planned))
    if ((unplanned > max_restarts)); then
        echo "swbert-slurm: error: job $tag was restarted $unplanned time(s) after a failure (node failure or requeue, not a pre-emption)," \
            "more than SWBERT_MAX_RESTARTS=$max_restarts: not starting again. See what ended the earlier runs in" \
            "$SWBERT_LOG_DIR (*-r<N>.log) and in sacct; then resubmit with the same --output-dir (it resumes" \
            "from the newest complete checkpoint), or raise SWBERT_MAX_RESTARTS" >&2
        echo "# restart $restart, $(date '+%F %T'): refused, $unplanned restart(s) after failures > SWBERT_MAX_RESTARTS=$max_restarts" >>"$SWBERT_LOG_DIR/job.txt"
        exit 3
    fi

    # Resume (entry points that checkpoint): `auto` unless the user chose otherwise; always `auto`
    # after a requeue.
    if [[ ${SWBERT_RESUMABLE:-1} == 1 ]]; then
        [[ -n $(swbert_arg resume "${args[@]}") ]] || args+=(--resume auto)
        ((restart == 0)) || args+=(--resume auto)
    fi

    {
        echo "# restart $restart, $(date '+%F %T'), $unplanned after failures (SWBERT_MAX_RESTARTS=$max_restarts)"
        echo "job=$SLURM_JOB_ID tag=$tag nodes=$SLURM_JOB_NODELIST nnodes=$nnodes per_node=$per_node launcher=$launch_mode"
        echo "cpus: node=$node_cpus per_task=$task_cpus per_process=$rank_cpus"
        echo "master=$MASTER_ADDR:$MASTER_PORT rdzv_timeout=${RDZV_TIMEOUT}s dist_timeout=${SWBERT_DIST_TIMEOUT_MIN}min"
        echo "nccl: NCCL_DEBUG=$NCCL_DEBUG${nccl_net:- (network chosen by NCCL)}"
        printf 'command: %s' "$entry"
        printf ' %q' "${args[@]}"
        echo
    } >>"$SWBERT_LOG_DIR/job.txt"
    swbert_log "job $tag restart $restart: $nnodes node(s) x $per_node process(es), $rank_cpus CPU(s) each, master $MASTER_ADDR:$MASTER_PORT, logs in $SWBERT_LOG_DIR"
    [[ -z $nccl_net ]] || swbert_log "NCCL network settings passed to every rank:$nccl_net"
    if ((rank_cpus == 1 && node_cpus < $(nproc --all))); then
        local per="node, for its $per_node process(es)"
        [[ $launch_mode == srun ]] && per="process"
        swbert_log "warning: each process has 1 CPU for its threads and loader workers (the allocation" \
            "holds $node_cpus per node): submit with --exclusive (whole nodes) or --cpus-per-task=N (N CPUs per $per)"
    fi

    # The step's CPUs are --cpus-per-task alone: a job submitted with --cpus-per-gpu has them in its
    # allocation already, and srun would also read SLURM_CPUS_PER_GPU as a request of the step.
    # --export=ALL: every task gets this script's environment (MASTER_ADDR, the NCCL settings, the
    # activated venv), also in a job submitted with --export=NONE or under a site's
    # SLURM_EXPORT_ENV=NONE, which a step would otherwise inherit and start with an empty one.
    local step_cmd
    if [[ $launch_mode == srun ]]; then
        # One task per GPU: the trainer maps SLURM_PROCID/LOCALID/NTASKS to RANK/LOCAL_RANK/WORLD_SIZE.
        step_cmd=(env -u SLURM_CPUS_PER_GPU srun --export=ALL --cpus-per-task="$task_cpus" --kill-on-bad-exit=1
            --output="$SWBERT_LOG_DIR/rank%t-r$restart.log" python "$entry" "${args[@]}")
    else
        step_cmd=(env -u SLURM_CPUS_PER_GPU srun --export=ALL --nodes="$nnodes" --ntasks="$nnodes" --ntasks-per-node=1
            --cpus-per-task="$task_cpus" --kill-on-bad-exit=1
            --output="$SWBERT_LOG_DIR/node%n-r$restart.log"
            bash "$SWBERT_ROOT/launchers/slurm/node_launch.sh" "$entry" "${args[@]}")
    fi

    SWBERT_STEP_PID=""
    SWBERT_SIGNALLED=""
    trap 'swbert_on_signal USR1' USR1
    trap 'swbert_on_signal TERM' TERM
    "${step_cmd[@]}" &
    SWBERT_STEP_PID=$!
    local rc=0
    while :; do
        rc=0
        wait "$SWBERT_STEP_PID" || rc=$?
        # wait returns early (status > 128) when a trapped signal arrives; the step still runs.
        kill -0 "$SWBERT_STEP_PID" 2>/dev/null || break
    done

    # Pre-empted: the training processes exit 75 (srun passes it on; torchrun reports it as 1, so
    # their log line counts too).
    if ((rc == 75)) || grep -qs "pre-empted: checkpoint saved at step" "$SWBERT_LOG_DIR"/*-r"$restart".log; then
        local max=${SWBERT_MAX_REQUEUES:-50}
        if ((restart >= max)); then
            swbert_log "checkpoint saved, but restart $restart reached SWBERT_MAX_REQUEUES=$max: not requeueing"
            exit 0
        fi
        swbert_log "checkpoint saved after ${SWBERT_SIGNALLED:-a signal}; requeueing job $SLURM_JOB_ID (it resumes with --resume auto)"
        # Marked before the requeue (SLURM ends this script once it runs): not a restart after a failure.
        touch "$SWBERT_LOG_DIR/requeued-r$restart"
        if ! scontrol requeue "$SLURM_JOB_ID"; then
            rm -f "$SWBERT_LOG_DIR/requeued-r$restart"
            swbert_die "scontrol requeue $SLURM_JOB_ID failed; resubmit with the same --output-dir to resume"
        fi
        exit 0
    fi
    if ((rc != 0)); then
        swbert_log "training step failed with status $rc; last lines of the logs in $SWBERT_LOG_DIR:"
        local f
        for f in "$SWBERT_LOG_DIR"/*-r"$restart".log; do
            [[ -f $f ]] || continue
            echo "==> $f <=="
            tail -n 20 "$f"
        done
        exit "$rc"
    fi
    swbert_log "finished"
}

swbert_on_signal() {
    SWBERT_SIGNALLED=SIG$1
    if [[ -z ${SWBERT_STEP_PID:-} ]]; then
        return
    fi
    if [[ $1 == USR1 ]]; then
        swbert_log "SIGUSR1: asking the training processes to checkpoint and stop"
        # srun forwards SIGUSR1 to every task of the step, on every node.
        kill -USR1 "$SWBERT_STEP_PID" 2>/dev/null || true
    else
        swbert_log "SIGTERM: job ending (cancelled or time limit); the training processes got it too"
    fi
}
