"""The offline quick start (`make finetune`) and the walk of the documented commands (`make docs-check`):
the data command writes what the launchers' documented flags read, and every documented command is
classified by an explicit rule, the quick start's among those that run."""

from __future__ import annotations

import re
import shlex

import pytest

from benchmarks import docs_commands
from swbert.finetune import synthetic
from swbert.finetune.glue_data import load_glue_split
from swbert.finetune.squad_data import read_squad_json
from swbert.finetune.tasks import get_task
from swbert.launchers import finetune_glue, finetune_squad
from tests.launch_utils import REPO


def launcher_flags(line: str) -> list[str]:
    """The flags printed after the launcher's name on one line of the data command's output."""
    return shlex.split(line.split(".py ", 1)[1])


def test_the_data_command_prints_the_flags_that_read_what_it_wrote(tmp_path, capsys):
    out = tmp_path / "data"
    assert synthetic.main(["--output", str(out), "--train-examples", "12", "--dev-examples", "5"]) == 0
    glue_line, squad_line = capsys.readouterr().out.strip().splitlines()
    common = ["--checkpoint", str(tmp_path / "ckpt"), "--output-dir", str(tmp_path / "ft")]
    glue = finetune_glue.parse_args(launcher_flags(glue_line) + common)
    squad = finetune_squad.parse_args(launcher_flags(squad_line) + common)
    assert glue.tasks == ["sst2"] and squad.versions == ["1.1"]
    task = get_task("sst2")
    assert len(load_glue_split(task, "train", glue.data_dir).labels) == 12
    assert len(load_glue_split(task, "validation", glue.data_dir).labels) == 5
    assert len(read_squad_json(squad.train_files()["1.1"], "1.1")) == 12
    assert len(read_squad_json(squad.dev_files()["1.1"], "1.1")) == 5


@pytest.mark.parametrize(
    "args, message",
    [
        (["--glue-tasks", "sst3"], "unknown GLUE task 'sst3'"),
        (["--train-examples", "0"], "train_examples=0 must be positive"),
        (["--squad-versions", "3.0"], "squad_versions='3.0' is not one of 1.1, 2.0"),
    ],
)
def test_bad_data_flags_are_one_line_errors(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exit_:
        synthetic.main(["--output", str(tmp_path), *args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and message in err, err


def test_every_documented_command_has_a_class_and_the_quick_start_runs():
    commands = docs_commands.documented_commands(REPO)
    by_text = {c.text: c for c in commands}
    assert by_text["make pretrain"].kind == by_text["make finetune"].kind == "cpu"
    order = [c.text for c in commands]
    assert order.index("make pretrain") < order.index("make finetune")  # the export it fine-tunes
    assert by_text["make test-gpu"].kind == "gpu" and by_text["make test"].kind == "suite"
    gpu_node = {c.kind for c in commands if "--num_gpus 8" in c.text}
    assert "gpu" in gpu_node and "cpu" not in gpu_node


def test_the_scripts_and_modules_the_runnable_commands_name_exist():
    """What the walk would find first, without running anything: a renamed file or module."""
    for cmd in docs_commands.documented_commands(REPO):
        if cmd.kind != "cpu" or cmd.lang != "sh":
            continue
        for path in re.findall(r"(?<![\w/])((?:launchers|benchmarks|data_prep)/[\w/]+\.(?:py|sh))", cmd.text):
            assert (REPO / path).is_file(), f"{cmd.source}: {path} does not exist"
        for module in re.findall(r"python3? -m ([\w.]+)", cmd.text):
            base = REPO / module.replace(".", "/")  # a file check: importing would cost seconds
            found = [base.with_suffix(".py"), base / "__main__.py"]
            assert any(f.is_file() for f in found), f"{cmd.source}: no module {module}"


def test_a_block_joins_continuations_loops_and_background_jobs(tmp_path):
    doc = tmp_path / "README.md"
    (tmp_path / "docs").mkdir()
    doc.write_text(
        "```bash\nexport A=1\nfor v in a b; do\n  echo $v\ndone\n"
        "python x.py --flag \\\n    --other 2   # a comment\nsleep 1 &\nmake pretrain\n```\n"
        "```\npython y.py [--opt VALUE]\nexample output, not a command\n```\n"
    )
    commands = docs_commands.documented_commands(tmp_path)
    assert [c.text.split()[0] for c in commands] == ["for", "python", "sleep", "python"]
    assert all(c.env_prefix == "export A=1\n" for c in commands[:3])
    assert commands[1].text == "python x.py --flag \\\n    --other 2"
    assert "wait" in commands[2].script() and commands[2].text.endswith("make pretrain")
    assert commands[3].script() == "python y.py"
