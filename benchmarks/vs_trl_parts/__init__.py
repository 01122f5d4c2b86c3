"""The pieces of `benchmarks/vs_trl.py`: `measure` (RSS, CPU load, step statistics, the shared held-out
evaluation), `children` (each trainer's run in its own process) and `report` (the summary, the ratios and the
printed comparison)."""
