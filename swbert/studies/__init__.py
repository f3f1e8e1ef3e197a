"""Studies: many training runs planned as points, run or read back, recorded, and tracked as one
MLflow parent run with a child per point (docs/architecture.md; `runner`, `jobs`, `records`,
`tracking`, `slurm`, `options`, `outputs`)."""
