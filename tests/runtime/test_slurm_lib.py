"""launchers/slurm without a cluster: the sbatch headers, and `swbert_job` (lib.sh) run with stand-ins
for srun, scontrol and nvidia-smi that record the step's command line and environment.

tests/e2e/test_slurm.py runs the same scripts against real SLURM daemons (slow); this checks in a
second what a step is given: its CPUs, the environment export, and NCCL's network settings.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.launch_utils import HANG_S, REPO

SLURM_DIR = REPO / "launchers" / "slurm"

FAKE_SRUN = """#!/usr/bin/env bash
printf '%s\\n' "$@" > "$SWBERT_FAKE_OUT/srun.args"
env > "$SWBERT_FAKE_OUT/srun.env"
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
case "$1 $2" in
"show hostnames") echo n1; echo n2 ;;
"show node") echo "NodeName=$3 Arch=x86_64 NodeAddr=10.1.2.3 NodeHostName=$3" ;;
*) exit 1 ;;
esac
"""
FAKE_NVIDIA_SMI = "#!/usr/bin/env bash\nexit 0\n"  # a CPU node: no GPU listed


def sbatch_options(script: Path) -> list[str]:
    """The #SBATCH options of a script, as sbatch reads them: up to the first command."""
    options = []
    for line in script.read_text().splitlines()[1:]:
        if line.startswith("#SBATCH"):
            options.append(line.split(None, 1)[1].strip())
        elif line.strip() and not line.startswith("#"):
            break
    return options


@pytest.mark.parametrize("script", sorted(p.name for p in SLURM_DIR.glob("*.sbatch")))
def test_every_sbatch_script_asks_for_whole_nodes(script: str):
    """--exclusive: every CPU of the node, which lib.sh gives the step (without it, the allocation of a
    one-task-per-node job holds one CPU, and torchrun's ranks and loader workers share it). No fixed
    --cpus-per-task: it would refuse nodes with fewer CPUs (the local test cluster's nodes have the
    host's) and read as per GPU in srun mode."""
    options = sbatch_options(SLURM_DIR / script)
    assert "--exclusive" in options, options
    assert not [o for o in options if o.startswith(("--cpus-per-task", "-c"))], options


def run_job(tmp_path: Path, command: str, **env: str) -> tuple[subprocess.CompletedProcess, list[str], dict]:
    """`command` (bash) in the repository root as the batch step of job 4242 on two 96-CPU nodes;
    returns the result, the arguments srun got and the environment its tasks started with."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in {"srun": FAKE_SRUN, "scontrol": FAKE_SCONTROL, "nvidia-smi": FAKE_NVIDIA_SMI}.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    base = {  # a clean environment: nothing of the test process's SLURM_* or NCCL_* settings
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "n[1-2]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_CPUS_PER_NODE": "96(x2)",
        "SLURM_SUBMIT_DIR": str(REPO),
        "SWBERT_VENV": str(tmp_path / "no-venv"),
        "SWBERT_LOG_ROOT": str(tmp_path / "logs"),
        "SWBERT_FAKE_OUT": str(tmp_path),
        "GPUS_PER_NODE": "8",
    }
    result = subprocess.run(
        ["bash", "-c", command], cwd=REPO, env={**base, **env}, capture_output=True, text=True, timeout=HANG_S
    )
    assert result.returncode == 0, result.stdout + result.stderr
    args = (tmp_path / "srun.args").read_text().splitlines()
    lines = (tmp_path / "srun.env").read_text().splitlines()
    step_env = dict(line.split("=", 1) for line in lines if "=" in line)
    return result, args, step_env


def job_txt(tmp_path: Path) -> str:
    return (tmp_path / "logs" / "swbert-4242" / "job.txt").read_text()


def test_the_step_gets_the_nodes_cpus_the_environment_and_nccl_settings(tmp_path):
    """One launcher per node: the step asks for all 96 CPUs of each node for its one task, runs with
    --export=ALL (a job submitted with --export=NONE would otherwise give its tasks an empty
    environment), and NCCL_SOCKET_IFNAME, set where the job was submitted, reaches the tasks and
    job.txt; NCCL_IB_HCA, unset, stays unset."""
    result, args, step_env = run_job(
        tmp_path,
        "bash launchers/slurm/pretrain.sbatch --config tiny_cpu",
        NCCL_SOCKET_IFNAME="^docker,lo",
        SLURM_EXPORT_ENV="NONE",  # what sbatch --export=NONE leaves for the steps to inherit
    )
    assert args[:2] == ["--export=ALL", "--nodes=2"], args
    assert "--ntasks-per-node=1" in args and "--cpus-per-task=96" in args, args
    assert args[args.index("bash") + 1].endswith("launchers/slurm/node_launch.sh"), args
    assert step_env["NCCL_SOCKET_IFNAME"] == "^docker,lo" and "NCCL_IB_HCA" not in step_env
    # the rest of what lib.sh exports reaches the tasks as well: first node's NodeAddr, 96 CPUs / 8 ranks
    wanted = {"MASTER_ADDR": "10.1.2.3", "NPROC_PER_NODE": "8", "OMP_NUM_THREADS": "12"}
    assert {k: step_env.get(k) for k in wanted} == wanted
    assert "nccl: NCCL_DEBUG=WARN NCCL_SOCKET_IFNAME=^docker,lo\n" in job_txt(tmp_path)
    assert "NCCL network settings passed to every rank: NCCL_SOCKET_IFNAME=^docker,lo" in result.stdout


def test_nccl_settings_assigned_in_a_script_reach_the_ranks_in_srun_mode(tmp_path):
    """One task per GPU (SWBERT_LAUNCHER=srun): each of a node's 8 tasks asks for 96 / 8 CPUs, and
    NCCL_IB_HCA assigned without `export` in a copy of the script reaches them too."""
    script = "NCCL_IB_HCA==mlx5_0:1,mlx5_1:1; set -uo pipefail; source launchers/slurm/lib.sh; " + (
        "swbert_job launchers/pretrain.py --config tiny_cpu"
    )
    _, args, step_env = run_job(
        tmp_path, script, SWBERT_LAUNCHER="srun", SLURM_NTASKS_PER_NODE="8", SLURM_NTASKS="16"
    )
    assert args[:2] == ["--export=ALL", "--cpus-per-task=12"], args
    assert step_env["NCCL_IB_HCA"] == "=mlx5_0:1,mlx5_1:1" and "NCCL_SOCKET_IFNAME" not in step_env
    assert "NCCL_IB_HCA==mlx5_0:1,mlx5_1:1" in job_txt(tmp_path)


def test_without_nccl_settings_nccl_chooses(tmp_path):
    _, _, step_env = run_job(tmp_path, "bash launchers/slurm/pretrain.sbatch --config tiny_cpu")
    assert not {"NCCL_SOCKET_IFNAME", "NCCL_IB_HCA"} & set(step_env)
    assert "nccl: NCCL_DEBUG=WARN (network chosen by NCCL)" in job_txt(tmp_path)
