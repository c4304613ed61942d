"""Training: the loop, its schedule, metrics, checkpoints, preemption, sampling and the CLI."""
