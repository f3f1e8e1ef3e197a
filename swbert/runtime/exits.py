"""Exit statuses a run's drivers act on (SLURM scripts, the scaling studies, `lib.sh`)."""

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: checkpointed on request, resume with --resume auto
