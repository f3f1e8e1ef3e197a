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
import time

from swbert import cli
from swbert.finetune.glue import GlueSweep, evaluate_finetuned, run_glue
from swbert.finetune.sweep import open_tracker, report_sweep
from swbert.logs import setup_logging

USAGE = "usage: launchers/finetune_glue.py --checkpoint [NAME=]PATH ... --output-dir DIR [--key value ...]"


def parse_args(argv: list[str] | None = None) -> GlueSweep:
    """The sweep's flags (`--help` lists them); exits with status 2 and the reason on bad input."""
    return cli.parse_or_exit(GlueSweep, argv, USAGE)


def main(argv: list[str] | None = None) -> int:
    sweep = parse_args(argv)
    setup_logging()
    tracker = open_tracker(sweep)
    name = sweep.run_name or f"glue-{time.strftime('%Y%m%d-%H%M%S')}"
    with tracker.sweep(name, "glue_sweep", sweep.params()) as parent:
        if sweep.evaluate_finetuned:
            evaluate_finetuned(
                sweep.checkpoints(),
                sweep.data_dir,
                tracker,
                sweep.max_seq_length,
                sweep.noise_levels,
                sweep.noise_seeds,
                sweep.cross_domain,
                sweep.max_eval_samples,
                sweep.eval_batch_size,
                sweep.noise_scales,
            )
        else:
            run_glue(sweep, tracker)
    report_sweep(tracker, sweep, parent)
    return 0


if __name__ == "__main__":
    sys.exit(main())
