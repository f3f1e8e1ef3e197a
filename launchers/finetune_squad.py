"""Fine-tune checkpoints on SQuAD v1.1 and/or v2.0 (paper Table 2).

    python launchers/finetune_squad.py --checkpoint standard=ckpt/std shared=ckpt/shared \\
        --output-dir runs/squad [--version 1.1 2.0] [--train-file 1.1=train-v1.1.json --dev-file 1.1=dev-v1.1.json]
    deepspeed --num_gpus 8 launchers/finetune_squad.py --deepspeed zero1.json ...

Without --train-file/--dev-file the data comes from the Hub (rajpurkar/squad, rajpurkar/squad_v2).
"""

from __future__ import annotations

import sys

from swbert import cli
from swbert.finetune.squad import SquadSweep, run_squad
from swbert.finetune.sweep import run_sweep

USAGE = "usage: launchers/finetune_squad.py --checkpoint [NAME=]PATH ... --output-dir DIR [--key value ...]"


def parse_args(argv: list[str] | None = None) -> SquadSweep:
    """The sweep's flags (`--help` lists them); exits with status 2 and the reason on bad input."""
    return cli.parse_or_exit(SquadSweep, argv, USAGE)


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 done; 2 bad input (flags, data files, checkpoints), with a one-line error."""
    return cli.exit_on_bad_input(lambda: run_sweep(parse_args(argv), "squad", run_squad))


if __name__ == "__main__":
    sys.exit(main())
