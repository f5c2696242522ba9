"""Running steps: one way to train a step, batches by index, crash-safe checkpoints, seeds."""
