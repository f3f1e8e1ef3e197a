"""Fine-tune checkpoints on GLUE (paper Table 1), optionally with noise (Table 5) and cross-domain (Table 6).

    python launchers/finetune_glue.py --checkpoint standard=ckpt/std shared=ckpt/shared \\
        --output-dir runs/glue [--data-dir glue_data] [--noise] [--cross-domain]
    deepspeed --num_gpus 8 launchers/finetune_glue.py --deepspeed zero1.json ...
    python launchers/finetune_glue.py --config my_glue.yaml --seeds 1 2 3   # flags from a file

Already fine-tuned models (one folder per task, grouped by NAME) can be evaluated without training:

    python launchers/finetune_glue.py --evaluate-finetuned --checkpoint shared=runs/glue/shared/mnli/... \\
        shared=runs/glue/shared/qnli/... --output-dir runs/eval --noise --cross-domain
"""

from __future__ import annotations

import sys

from swbert import cli
from swbert.finetune.glue import GlueSweep, run_glue
from swbert.finetune.sweep import run_sweep

USAGE = "usage: launchers/finetune_glue.py --checkpoint [NAME=]PATH ... --output-dir DIR [--key value ...]"


def parse_args(argv: list[str] | None = None) -> GlueSweep:
    """The sweep's flags (`--help` lists them); exits with status 2 and the reason on bad input."""
    return cli.parse_or_exit(GlueSweep, argv, USAGE)


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 done; 2 bad input (flags, data files, checkpoints), with a one-line error."""
    return cli.exit_on_bad_input(lambda: run_sweep(parse_args(argv), "glue", run_glue))


if __name__ == "__main__":
    sys.exit(main())
