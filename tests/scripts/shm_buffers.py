"""One rank of a CPU job: start the process group as training does, then print which of the job's
DeepSpeed shared-memory buffers still have a name in /dev/shm, and the result of one all-reduce
through DeepSpeed's shared-memory collective (which must still work once the names are gone).

    LOCAL_SIZE=2 ... python tests/scripts/shm_buffers.py   # under tests/launch_utils.launch(2, ...)
"""

import os

import deepspeed.comm
import torch

from swbert.runtime.dist import SHM_BUFFER, init_distributed

rank, _, world = init_distributed()
torch.distributed.barrier()  # every rank has unlinked its own name: only then look at the others'
names = [
    SHM_BUFFER.format(uid=os.getuid(), addr=os.environ["MASTER_ADDR"], port=os.environ["MASTER_PORT"], rank=r)
    for r in range(world)
]
left = [n for n in names if os.path.exists(n)]
total = torch.full((4,), float(rank + 1))
deepspeed.comm.inference_all_reduce(total)
print(f"rank {rank}: named {len(left)} sum {total.tolist()}", flush=True)
torch.distributed.barrier()
torch.distributed.destroy_process_group()
