"""ampkit inside other trainers: a Lightning precision plugin, a Hugging Face ``Trainer`` and callback.

Each module imports its framework when imported (``pip install "ampkit[lightning]"`` /
``"ampkit[hf]"``); this package itself imports nothing. The glue they share is in :mod:`.common`.
"""

__all__: list = []
