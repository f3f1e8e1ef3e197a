"""Masked-LM pretraining of a swbert model with DeepSpeed.

    deepspeed --num_gpus 8 launchers/pretrain.py --config base_shared --data-dir data/wiki
    torchrun --nproc_per_node 2 launchers/pretrain.py --size tiny --train-steps 20
    deepspeed launchers/pretrain.py            # the embedded default recipe, on any machine

Run with --help for every option.
"""

from swbert.training.cli import main

if __name__ == "__main__":
    main()
