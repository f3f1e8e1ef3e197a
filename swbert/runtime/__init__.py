"""What pretraining, fine-tuning and scaling share, and nothing of theirs.

`ranks` (who am I: rank, world, local rank), `dist` (the process group, its timeouts and the
heartbeat that names a lost rank), `ds_config` (a DeepSpeed JSON filled from a run's own
settings), `optim` (AdamW, parameter groups, the LR schedule), `extensions` (DeepSpeed op builds),
`cpu` (CPU threads and kernels), `recompute` (what selective activation checkpointing keeps),
`monitor` (system metrics, peak TFLOP/s), `tracking` (where MLflow runs go), `checkpoint_format`
(a checkpoint folder's layout) and `run_tokenizer` (a run's copy of its tokenizer). The layers are
listed in docs/architecture.md; this package imports only the model, the data readers and the
base modules below it.
"""
