"""One rank of a 2-rank job that reads a --data-mix through the trainer's loader (DataLoader
workers) and reports where each of its samples came from.

    python tests/scripts/mix_draws.py OUT.json A=0.75 B=0.25   # RANK, WORLD_SIZE, MASTER_* set

Rank 0 writes [[stream position, folder index, sample index in the folder], ...] of every rank.
"""

import json
import sys

import torch.distributed as dist

from swbert.data.mix import parse_data_mix
from swbert.training.data import TrainingData

MICRO, STEPS, SEQ = 4, 12, 64

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
data = TrainingData(parse_data_mix(sys.argv[2:]), SEQ, 0.15, 1234)
loader = data.loader(0, MICRO, rank, world, num_workers=1)
rows = []
for step in range(STEPS):
    batch = next(loader)
    first = step * MICRO * world + rank * MICRO  # this rank's first stream position in the batch
    rows += [
        [first + i, s, n] for i, (s, n) in enumerate(zip(batch["source"].tolist(), batch["sample"].tolist()))
    ]
loader.close()
gathered = [None] * world
dist.all_gather_object(gathered, rows)
if rank == 0:
    with open(sys.argv[1], "w") as out:
        json.dump([row for part in gathered for row in part], out)
dist.destroy_process_group()
