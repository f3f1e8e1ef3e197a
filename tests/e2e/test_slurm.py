"""The sbatch scripts against a real SLURM: munged, slurmctld and two slurmd "nodes" on this host.

launchers/slurm/local_cluster.sh installs the Debian packages when missing and starts the daemons
from a private state folder; the fixture stops them by pid at the end, also when a test fails.
"""

from __future__ import annotations

import json
import os
import runpy
import shlex
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from swbert.data import loader
from swbert.runtime.cpu import set_cpu_threads
from tests.csv_utils import read_csv
from tests.launch_utils import HANG_S, REPO, job_env, read_metrics

pytestmark = pytest.mark.slow

CLUSTER_SCRIPT = REPO / "launchers" / "slurm" / "local_cluster.sh"
PRETRAIN_SBATCH = "launchers/slurm/pretrain.sbatch"
PREPROCESS_SBATCH = "launchers/slurm/preprocess.sbatch"


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "a local SLURM needs root (slurmd runs jobs as their user, munged as the munge user)"
    if shutil.which("slurmctld") is None and shutil.which("apt-get") is None:
        return "SLURM is not installed and apt-get is unavailable to install it"
    return None


def _free_ports(count: int) -> int:
    """The first of `count` consecutive free TCP ports (slurmd ports must be consecutive)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count > 65000:
            continue
        ok = True
        for port in range(base, base + count):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no consecutive free ports")


class Cluster:
    def __init__(self, state: Path) -> None:
        self.state = state
        node_port = _free_ports(2)
        self.env = job_env(
            SWBERT_SLURM_DIR=str(state),
            SWBERT_SLURM_NODES="2",
            SWBERT_SLURM_CTLD_PORT=str(_free_ports(1)),
            SWBERT_SLURM_NODE_PORT=str(node_port),
            SLURM_CONF=str(state / "slurm.conf"),
        )

    # Every wait below is on an event (a command's end, a job leaving the queue, a file or a line
    # appearing) with the one hang guard, HANG_S: a loaded machine starts daemons and jobs late.
    def script(self, action: str, timeout: float = HANG_S) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", str(CLUSTER_SCRIPT), action],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def run(self, *cmd: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            list(cmd),
            cwd=REPO,
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=HANG_S,
        )

    def sbatch(self, *args: str, env: dict[str, str] | None = None) -> int:
        result = self.run("sbatch", "--parsable", *args, env=env)
        assert result.returncode == 0, result.stderr
        return int(result.stdout.strip().split(";")[0])

    def states(self, job: int) -> str:
        return self.run("squeue", "-h", "-j", str(job), "-o", "%T").stdout.strip()

    def wait(self, job: int, timeout: float = HANG_S) -> list[str]:
        """Wait until the job has left the queue; the states seen on the way."""
        seen: list[str] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.states(job)
            if not state:
                return seen
            if not seen or seen[-1] != state:
                seen.append(state)
            time.sleep(1)
        self.run("scancel", str(job))
        raise AssertionError(f"job {job} still queued after {timeout:.0f}s; states {seen}\n{self.logs()}")

    def accounting(self, job: int) -> list[tuple[str, str]]:
        """(state, exit code) of each run of the job, from the job-completion log."""
        out = self.run("sacct", "-c", "-n", "-P", "-j", str(job), "-o", "jobid,state,exitcode").stdout
        return [tuple(line.split("|")[1:3]) for line in out.splitlines() if line.strip()]  # type: ignore[misc]

    def node_cpus(self) -> int:
        """CPUs a node declares (every node declares the host's)."""
        return int(self.run("sinfo", "-h", "-n", "n1", "-o", "%c").stdout.strip())

    def logs(self) -> str:
        parts = []
        for path in sorted((self.state / "log").glob("*.log")):
            parts.append(f"==> {path.name} <==\n" + "\n".join(path.read_text().splitlines()[-15:]))
        return "\n".join(parts)


@pytest.fixture(scope="module")
def cluster():
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    state = Path(tempfile.mkdtemp(prefix="swbert-slurm-"))  # private (0700); the script sets its mode
    c = Cluster(state)
    started = time.time()
    try:
        result = c.script("start")
        assert result.returncode == 0, f"local_cluster.sh start failed:\n{result.stderr}\n{c.logs()}"
        print(f"SLURM up in {time.time() - started:.1f}s (install included)")
        yield c
    finally:
        stop = c.script("stop")
        pids = list((state / "pids").glob("*.pid")) + list((state / "munge").glob("*.pid"))
        shutil.rmtree(state, ignore_errors=True)
        assert stop.returncode == 0, stop.stderr
        assert not pids, f"daemons left running: {pids}"


def tiny(data_dir: Path, out: Path, *extra: str) -> list[str]:
    return ["--config", "tiny_cpu", "--data-dir", str(data_dir), "--output-dir", str(out), *extra]


def test_two_node_pretraining_preempted_requeued_and_resumed(cluster, data_dir, tmp_path):
    """2 nodes x 1 process through sbatch; SIGUSR1 mid-run -> checkpoint -> requeue -> finish."""
    out, logs = tmp_path / "run", tmp_path / "logs"
    # a tiny step takes about 0.15 s on an idle machine: enough steps that the signal, sent once 3
    # are logged, always lands before the last one (it lands 2-4 steps later; with 20 the run could
    # finish first)
    steps = 40
    job = cluster.sbatch(
        "--nodes=2",
        "--exclusive",  # whole nodes, as a pretraining job asks for
        f"--output={tmp_path}/slurm-%j.out",
        PRETRAIN_SBATCH,
        *tiny(data_dir, out, "--train-steps", str(steps), "--log-interval", "1", "--save-interval", "1000"),
        # the requeue after a pre-emption checkpoint is no restart after a failure: allowed at 0
        env={"SWBERT_LOG_ROOT": str(logs), "SWBERT_MAX_RESTARTS": "0"},
    )
    batch_log = tmp_path / f"slurm-{job}.out"
    # Pre-empt once a few steps are logged.
    deadline = time.monotonic() + HANG_S
    while time.monotonic() < deadline:
        metrics = out / "metrics.jsonl"
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:
            break
        assert cluster.states(job), f"job ended before the signal:\n{batch_log.read_text()}"
        time.sleep(0.5)
    else:
        raise AssertionError(f"no metrics after {HANG_S:.0f}s:\n{batch_log.read_text()}\n{cluster.logs()}")
    signalled = cluster.run("scancel", "--signal=USR1", "--batch", str(job))
    assert signalled.returncode == 0, signalled.stderr
    seen = cluster.wait(job)

    text = batch_log.read_text()
    job_logs = logs / f"swbert-pretrain-{job}"
    assert "SIGUSR1: asking the training processes to checkpoint" in text, text
    assert "requeueing job" in text and "restart 1:" in text and "finished" in text, text
    assert "PENDING" in seen or "REQUEUED" in seen, seen
    # The step on both nodes asked for all their CPUs, for the one rank each runs.
    cpus = cluster.node_cpus()
    assert f"cpus: node={cpus} per_task={cpus} per_process={cpus}" in (job_logs / "job.txt").read_text()
    # Two runs of the job: requeued, then completed with exit code 0.
    runs = cluster.accounting(job)
    assert runs[-1] == ("COMPLETED", "0:0"), runs
    assert len(runs) == 2, runs
    # Both nodes took part in each run; the first checkpointed, the second resumed from it.
    first = "".join(p.read_text() for p in sorted(job_logs.glob("node*-r0.log")))
    second = "".join(p.read_text() for p in sorted(job_logs.glob("node*-r1.log")))
    assert len(list(job_logs.glob("node*-r0.log"))) == 2 and len(list(job_logs.glob("node*-r1.log"))) == 2
    saved = int(first.split("pre-empted: checkpoint saved at step ")[1].split()[0])
    assert 3 <= saved < steps
    assert f"at step {saved}" in second and "resumed from" in second, second
    # Metrics cover every step exactly once across the two runs; the world had 2 ranks.
    metrics = read_metrics(out)
    assert sorted(metrics) == list(range(1, steps + 1))
    assert all(r["loss"] == r["loss"] for r in metrics.values())  # no NaN
    resolved = (out / "resolved_config.yaml").read_text()
    assert "resume: auto" in resolved
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert latest.endswith(f"{steps:08d}") and (out / "checkpoints" / latest).is_dir()
    assert (out / "export" / "config.json").is_file()


def test_restarts_after_failures_stop_at_the_limit(cluster, data_dir, tmp_path):
    """With --requeue SLURM starts a job again after a node failure; SWBERT_MAX_RESTARTS bounds how
    often. Here 0: the running job is requeued (`scontrol requeue`, what SLURM does when a node
    fails), and its next start refuses with exit status 3 and says why, without training again."""
    logs = tmp_path / "logs"
    job = cluster.sbatch(
        "--nodes=1",
        f"--output={tmp_path}/slurm-%j.out",
        PRETRAIN_SBATCH,
        *tiny(data_dir, tmp_path / "run", "--train-steps", "100000"),
        env={"SWBERT_LOG_ROOT": str(logs), "SWBERT_MAX_RESTARTS": "0"},
    )
    job_txt = logs / f"swbert-pretrain-{job}" / "job.txt"
    deadline = time.monotonic() + HANG_S
    while not job_txt.is_file():  # the first run is under way
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.5)
    requeued = cluster.run("scontrol", "requeue", str(job))
    assert requeued.returncode == 0, requeued.stderr
    cluster.wait(job)
    text = (tmp_path / f"slurm-{job}.out").read_text()
    assert f"job {job} was restarted 1 time(s) after a failure" in text, text
    assert "more than SWBERT_MAX_RESTARTS=0: not starting again" in text and "--output-dir" in text
    assert cluster.accounting(job)[-1] == ("FAILED", "3:0"), cluster.accounting(job)
    assert "refused, 1 restart(s) after failures" in job_txt.read_text()
    assert not list(job_txt.parent.glob("*-r1.log"))  # no training step started the second time


def test_the_local_cluster_keeps_its_state_private(cluster, tmp_path):
    """The state folder is never a fixed path in /tmp: only root lists it or creates entries in it,
    its logs and state are root's alone, and a folder others can write, or none, is refused."""
    assert stat.S_IMODE(cluster.state.stat().st_mode) == 0o711
    for sub in ("log", "ctld", "pids"):
        assert stat.S_IMODE((cluster.state / sub).stat().st_mode) == 0o700, sub
    unset = {k: v for k, v in cluster.env.items() if k != "SWBERT_SLURM_DIR"}
    status = subprocess.run(
        ["bash", str(CLUSTER_SCRIPT), "status"], env=unset, capture_output=True, text=True
    )
    assert status.returncode != 0 and "SWBERT_SLURM_DIR is not set" in status.stderr
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    refused = subprocess.run(
        ["bash", str(CLUSTER_SCRIPT), "start"],
        env={**cluster.env, "SWBERT_SLURM_DIR": str(shared)},
        capture_output=True,
        text=True,
    )
    assert refused.returncode != 0 and "is writable by others" in refused.stderr
    assert not list(shared.iterdir())


def test_bad_requests_fail_fast_with_a_message(cluster, data_dir, tmp_path):
    """A node count that disagrees with the allocation and a missing recipe: the job fails in seconds."""
    wrong_nodes = cluster.sbatch(
        "--nodes=2",
        f"--output={tmp_path}/slurm-%j.out",
        PRETRAIN_SBATCH,
        *tiny(data_dir, tmp_path / "a"),
        env={"NNODES": "3", "SWBERT_LOG_ROOT": str(tmp_path / "logs")},
    )
    no_recipe = cluster.sbatch(
        "--nodes=1",
        f"--output={tmp_path}/slurm-%j.out",
        PRETRAIN_SBATCH,
        "--config",
        "recipes/missing.yaml",
        env={"SWBERT_LOG_ROOT": str(tmp_path / "logs")},
    )
    for job in (wrong_nodes, no_recipe):
        cluster.wait(job)
        assert cluster.accounting(job)[-1] == ("FAILED", "2:0")
    nodes_msg = (tmp_path / f"slurm-{wrong_nodes}.out").read_text()
    assert "NNODES=3 but the allocation has 2 node(s)" in nodes_msg and "sbatch --nodes=3" in nodes_msg
    recipe_msg = (tmp_path / f"slurm-{no_recipe}.out").read_text()
    assert "recipe recipes/missing.yaml not found (--config)" in recipe_msg and "tiny_cpu" in recipe_msg


def test_scaling_grid_runs_as_a_job_array(cluster, data_dir, tmp_path):
    """The scaling driver emits its grid as a job array; each task is one point; --collect tabulates."""
    out = tmp_path / "scaling"
    # The launcher's main in this process (writing the sweep needs no cluster and starts nothing): a
    # second interpreter would only import torch again.
    main = runpy.run_path(str(REPO / "launchers" / "scaling_study.py"), run_name="launcher")["main"]
    main(["--emit-slurm", "--nodes", "1", "--gpus-per-node", "0", "--sizes", "tiny", "--attention", "standard",
          "shared", "--layouts", "z2", "--steps", "3", "--seq-len", "64", "--micro-batch", "4",
          "--data-dir", str(data_dir), "--output-dir", str(out)])  # fmt: skip
    command = shlex.split((out / "submit.sh").read_text().splitlines()[-1])
    assert command[:2] == ["sbatch", "--array=0-1"], command
    # One task per process here (SWBERT_LAUNCHER=srun): the trainer maps SLURM's rank variables.
    job = cluster.sbatch(
        f"--output={tmp_path}/slurm-%A_%a.out",
        "--exclusive",  # a node each, with its CPUs (tasks are bound to what they are given)
        *command[1:],
        env={"SWBERT_LAUNCHER": "srun", "SWBERT_LOG_ROOT": str(tmp_path / "logs")},
    )
    cluster.wait(job)
    for task in (0, 1):
        text = (tmp_path / f"slurm-{job}_{task}.out").read_text()
        assert "finished" in text, text
        assert "launcher=srun" in (tmp_path / "logs" / f"swbert-scaling-{job}_{task}" / "job.txt").read_text()
    collected = subprocess.run(
        [sys.executable, "launchers/scaling_study.py", "--collect", str(out)],
        cwd=REPO, env=cluster.env, capture_output=True, text=True, timeout=HANG_S,
    )  # fmt: skip
    assert collected.returncode == 0, collected.stderr
    rows = read_csv(out / "scaling.csv")
    assert sorted(r["name"] for r in rows) == ["tiny-shared-tp1-z2", "tiny-standard-tp1-z2"]
    for row in rows:
        assert row["status"] == "measured" and float(row["tokens_per_s"]) > 0, row
        assert float(row["loss_last"]) > 0
    assert (out / "plots" / "throughput.png").stat().st_size > 0


@pytest.mark.long
def test_quality_ladder_runs_as_a_job_array_and_collect_fits_it(cluster, data_dir, tmp_path):
    """The quality study's ladder as an array (a task per point, the real trainer), then --collect
    fits what the tasks left. (Long: four trained points; one seed.)"""
    out = tmp_path / "quality"
    main = runpy.run_path(str(REPO / "launchers" / "scaling_study.py"), run_name="launcher")["main"]
    flags = ["--sizes", "1x64", "2x64", "2x128", "3x128", "--attentions", "standard", "--seeds", "1",
             "--tokens-per-param", "0.5", "--global-batch", "8", "--micro-batch", "8", "--seq-len", "64", "--eval-batches", "2",
             "--data-dir", str(data_dir), "--output-dir", str(out), "--mlflow", "false", "--bootstrap", "50"]  # fmt: skip
    assert main(["--quality", "--emit-slurm", *flags]) == 0
    command = shlex.split((out / "submit.sh").read_text().splitlines()[-1])
    assert command[:3] == ["sbatch", "--array=0-3", "launchers/slurm/quality.sbatch"], command
    job = cluster.sbatch(f"--output={tmp_path}/slurm-%A_%a.out", "--exclusive", *command[1:])
    cluster.wait(job)
    for task in range(4):
        text = (tmp_path / f"slurm-{job}_{task}.out").read_text()
        assert f"finished quality point {task}" in text, text + cluster.logs()
    assert not (out / "fits.json").exists()
    collected = subprocess.run(
        [sys.executable, "launchers/scaling_study.py", "--quality", "--collect", *flags],
        cwd=REPO, env=cluster.env, capture_output=True, text=True, timeout=HANG_S,
    )  # fmt: skip
    assert collected.returncode == 0, collected.stderr
    fits = json.loads((out / "fits.json").read_text())
    # every task's point is read back: fitted, or left out as at the data's floor with its reason
    standard = fits["variants"]["standard"]
    names = [p["name"] for p in standard["points"]] + [e["name"] for e in standard["excluded"]]
    assert sorted(names) == sorted(f"{s}-standard-s1" for s in ("1x64", "2x64", "2x128", "3x128")), standard
    assert all("floor" in e["reason"] for e in standard["excluded"]), standard["excluded"]


def _preprocess_array(cluster, data_dir: Path, tmp_path: Path, preempt: bool) -> tuple[str, str]:
    """Submit preprocess.sbatch as an array of 2 tasks on the tiny corpus; with `preempt`, send task 1
    SLURM's pre-emption warning (SIGUSR1) as it starts. Checks that the folder's manifest (shard
    sha256s included) is a single run's; returns the two tasks' logs."""
    from data_prep.preprocess import preprocess

    corpus, tok = data_dir.parent / "corpus.txt", data_dir.parent / "tok"
    settings = {"shard_bytes": 8 << 10, "valid_fraction": 0.1}
    preprocess([str(corpus)], tok, tmp_path / "single", workers=1, progress=False, **settings)
    out = tmp_path / "shards"
    job = cluster.sbatch(
        "--array=0-1",
        f"--output={tmp_path}/slurm-%A_%a.out",
        PREPROCESS_SBATCH,
        *("--input", str(corpus), "--tokenizer", str(tok), "--output", str(out), "--no-progress"),
        *("--shard-size", "8K", "--valid-fraction", "0.1"),
    )
    logs = [tmp_path / f"slurm-{job}_{task}.out" for task in (0, 1)]
    if preempt:
        deadline = time.monotonic() + HANG_S
        while not (logs[1].is_file() and "preprocess task 1 of 2" in logs[1].read_text()):
            assert time.monotonic() < deadline, cluster.logs()
            time.sleep(0.2)
        signalled = cluster.run("scancel", "--signal=USR1", "--batch", f"{job}_1")
        assert signalled.returncode == 0, signalled.stderr
    cluster.wait(job)
    first, second = (log.read_text() for log in logs)
    assert "finished task 0 of 2" in first and "finished task 1 of 2" in second, first + second
    assert (out / "manifest.json").read_text() == (tmp_path / "single" / "manifest.json").read_text()
    assert json.loads((out / "tasks.json").read_text())["num_tasks"] == 2
    return first, second


def test_preprocess_job_array_writes_the_single_run_folder(cluster, data_dir, tmp_path):
    """Two array tasks share one output folder: its manifest is a single run's."""
    _preprocess_array(cluster, data_dir, tmp_path, preempt=False)


@pytest.mark.long
def test_a_preempted_preprocess_task_requeues_itself_and_resumes(cluster, data_dir, tmp_path):
    """Task 1 gets SIGUSR1 as it starts: it stops, requeues itself and, run again, finishes; whichever
    task finishes last writes the manifest. (Long: a third interpreter start, about 10 s of CPU.)"""
    _, second = _preprocess_array(cluster, data_dir, tmp_path, preempt=True)
    assert "SIGUSR1: stopping the task" in second and "requeueing job" in second, second
    assert "restart 1: preprocess task 1 of 2" in second, second


def test_finetune_job_on_one_node(cluster, tmp_path):
    """finetune.sbatch runs the GLUE launcher on a tiny checkpoint; a wrong task family is refused."""
    from swbert.finetune.synthetic import write_glue_fixture
    from tests.finetune_fixtures import make_checkpoint

    write_glue_fixture(tmp_path / "glue", ["sst2"], n_train=64, n_dev=16)
    checkpoint = make_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "glue-out"
    job = cluster.sbatch(
        "--nodes=1",
        "--exclusive",  # the node's CPUs, not one (tasks are bound to what they are given)
        f"--output={tmp_path}/slurm-%j.out",
        "launchers/slurm/finetune.sbatch",
        "glue",
        *("--checkpoint", f"tiny={checkpoint}", "--tasks", "sst2", "--data-dir", str(tmp_path / "glue")),
        *("--output-dir", str(out), "--learning-rates", "1e-3", "--seeds", "1", "--epochs", "1"),
        *("--batch-size", "16", "--max-seq-length", "32"),
        env={"SWBERT_LOG_ROOT": str(tmp_path / "logs")},
    )
    bogus = cluster.sbatch(f"--output={tmp_path}/slurm-%j.out", "launchers/slurm/finetune.sbatch", "mnli")
    cluster.wait(job)
    cluster.wait(bogus)
    text = (tmp_path / f"slurm-{job}.out").read_text()
    assert cluster.accounting(job)[-1] == ("COMPLETED", "0:0"), text + cluster.logs()
    assert (out.parent / "mlflow.db").is_file()
    job_txt = (tmp_path / "logs" / f"swbert-finetune-{job}" / "job.txt").read_text()
    assert "--resume" not in job_txt
    assert cluster.accounting(bogus)[-1] == ("FAILED", "2:0")
    assert (
        "first argument must be glue or squad (got 'mnli')" in (tmp_path / f"slurm-{bogus}.out").read_text()
    )


# Run as the job's entry point on every rank: what its process may run on, and what swbert sizes
# from that (the trainer's calls), one JSON file per rank.
CPU_PROBE = """
import json, os, sys
from pathlib import Path

import torch

from swbert.runtime.cpu import set_cpu_threads
from swbert.data.loader import resolve_num_workers
from swbert.runtime.dist import map_launcher_env

map_launcher_env()  # srun mode: RANK from SLURM_PROCID, as the trainer does
set_cpu_threads(None)
record = {
    "node": os.environ.get("SLURMD_NODENAME"),
    "affinity": sorted(os.sched_getaffinity(0)),
    "threads": torch.get_num_threads(),
    "workers": resolve_num_workers(64),
    "omp": os.environ.get("OMP_NUM_THREADS"),
}
out = Path(os.environ["SWBERT_PROBE_OUT"])
out.mkdir(parents=True, exist_ok=True)
(out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(record))
"""


def test_every_rank_gets_the_cpus_its_step_asked_for(cluster, tmp_path):
    """The cluster binds tasks to cores (task/affinity), and since Slurm 22.05 a step that does not
    ask for CPUs gets one per task: without --cpus-per-task on the step every rank below would see
    one core. On whole nodes, the per-node launcher's task holds all the node's CPUs and its two
    ranks split them; a task of srun mode holds the node's CPUs alone. Threads, loader workers and
    OMP_NUM_THREADS follow. (The two jobs run at once, one per node; the pre-emption test checks the
    step of a two-node job.)"""
    node_cpus = cluster.node_cpus()
    if node_cpus < 2:
        pytest.skip(f"the nodes have {node_cpus} CPU: nothing to split")
    probe = tmp_path / "cpu_probe.py"
    probe.write_text(CPU_PROBE)
    modes = {  # name: (environment, ranks, CPUs each rank should use)
        "torchrun": ({"GPUS_PER_NODE": "2"}, 2, node_cpus // 2),
        "srun": ({"SWBERT_LAUNCHER": "srun"}, 1, node_cpus),
    }
    jobs = {}
    for name, (env, _, _) in modes.items():
        jobs[name] = cluster.sbatch(
            "--nodes=1",
            "--exclusive",
            f"--output={tmp_path}/slurm-%j.out",
            PRETRAIN_SBATCH,
            # OMP_NUM_THREADS empty: the script sets it, as on a cluster
            env={"SWBERT_ENTRY": str(probe), "SWBERT_PROBE_OUT": str(tmp_path / name), "OMP_NUM_THREADS": "",
                 "SWBERT_LOG_ROOT": str(tmp_path / "logs"), **env},
        )  # fmt: skip
    for name, job in jobs.items():
        cluster.wait(job)
        text = (tmp_path / f"slurm-{job}.out").read_text()
        assert cluster.accounting(job)[-1] == ("COMPLETED", "0:0"), f"{name}:\n{text}\n{cluster.logs()}"
        _, ranks, share = modes[name]
        records = [json.loads(p.read_text()) for p in sorted((tmp_path / name).glob("rank*.json"))]
        assert len(records) == ranks, (name, records, text)
        for record in records:
            assert len(record["affinity"]) == node_cpus, (name, record)
            assert record["threads"] == share and record["workers"] == share, (name, record)
            assert record["omp"] == str(share), (name, record)
        job_txt = (tmp_path / "logs" / f"swbert-pretrain-{job}" / "job.txt").read_text()
        assert f"cpus: node={node_cpus} per_task={node_cpus} per_process={share}" in job_txt, job_txt


def test_rank_cpus_share_what_the_process_may_run_on(monkeypatch):
    """Threads and loader workers of a rank: its process's CPUs, at most SLURM_CPUS_PER_TASK,
    divided between the ranks one launcher started (torchrun, the deepspeed launcher)."""
    for var in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "SLURM_CPUS_PER_TASK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(loader, "usable_cpus", lambda: 8)
    assert loader.rank_cpus() == 8  # a task of its own, bound to 8 CPUs (srun mode)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun's four ranks on the node task's CPUs
    assert loader.rank_cpus() == 2 and loader.resolve_num_workers(6) == 2
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("LOCAL_SIZE", "2")  # the deepspeed launcher's name for it
    assert loader.rank_cpus() == 4
    monkeypatch.delenv("LOCAL_SIZE")
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "3")  # a step that does not bind: what it asked for
    assert loader.rank_cpus() == 3
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert loader.rank_cpus() == 1  # never none
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "")  # empty or not a count: ignored
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert loader.rank_cpus() == 4
    threads = torch.get_num_threads()
    try:
        set_cpu_threads(None)
        assert torch.get_num_threads() == (threads if torch.cuda.is_available() else 4)
        set_cpu_threads(3)
        assert torch.get_num_threads() == (threads if torch.cuda.is_available() else 3)
    finally:
        torch.set_num_threads(threads)
