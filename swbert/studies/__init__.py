"""Studies: many training runs planned as points, run or read back, recorded, and tracked as one
MLflow parent run with a child per point (the systems grid and quality ladder of
`swbert.scaling`, the GLUE and SQuAD sweeps of `swbert.finetune`).

- `runner`: settle each point (skip the finished, resume the one in flight, record failures),
  a child run per point, absolute paths, SIGTERM as Ctrl-C
- `jobs`: a point's torchrun job tied to the study, its time limit, the wait for a held folder
- `records`: point records and the study's options (a changed study is refused)
- `tracking`: the MLflow parent and child runs
- `slurm`: a study as a job array
"""
