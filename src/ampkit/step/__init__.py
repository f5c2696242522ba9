"""The training step: precision, hardware, config, loss scaling, the engine and its policies."""
