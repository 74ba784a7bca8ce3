"""Prefect flows: the training run (rl-train) and the `rollflow` command line."""
