"""Running many steps: the Trainer, checkpoints, built-in models and data, bench and tune."""
