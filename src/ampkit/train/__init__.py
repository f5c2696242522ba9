"""The Trainer: epochs, evaluation, checkpoints on a schedule, graceful stops, spike rollback, its
choices before the first step, its run log and summary; and its settings."""
