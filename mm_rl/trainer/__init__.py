"""The GRPO trainer: the loop, checkpoints, metrics."""
