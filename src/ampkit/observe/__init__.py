"""Observers: watch the step through the engine's event stream without changing it."""
