"""Helpers the tests share: sync counting and clean-exit checks (``helpers``), real multi-process
runs on gloo (``dist_helpers``), the hand-written torch.amp loop (``reference_loop``), a model that
overflows fp16 (``unstable_model``). Files a subprocess names by module path stay where that path
points (``tests/rank_fault.py``, ``tests/service/unstable_factory.py``)."""
