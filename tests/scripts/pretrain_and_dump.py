"""Run pretraining in-process, then dump the engine's logits on a fixed batch (for export parity).

Rank 0 ends with the closing summary, as launchers/pretrain.py does."""

import os
import sys

import torch

from swbert.training.cli import closing_summary, parse_args
from swbert.training.trainer import Trainer, setup_logging

argv = sys.argv[1:]
i = argv.index("--dump-logits")
dump_path = argv[i + 1]
del argv[i : i + 2]
setup_logging()
trainer = Trainer(parse_args(argv))
summary = trainer.train()
assert summary["status"] == "FINISHED", summary
if "export_dir" in summary:
    print(closing_summary(summary), flush=True)
torch.manual_seed(0)
input_ids = torch.randint(5, trainer.run.model_config.vocab_size, (2, 16))
trainer.run.engine.eval()
with torch.no_grad():
    logits = trainer.run.engine(input_ids=input_ids).logits.float()  # collective under ZeRO-3
if torch.distributed.get_rank() == 0:
    torch.save({"input_ids": input_ids, "logits": logits}, dump_path)
torch.distributed.barrier()
torch.distributed.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # as launchers/pretrain.py: no teardown race of the communicators' threads
