"""Moved to :mod:`ampkit.choose.bench`, and ``tune`` and ``Recommendation`` to
:mod:`ampkit.choose.recommend` (issue 35); this path stays for imports written before."""

from ..choose.bench import *  # noqa: F403
from ..choose.recommend import *  # noqa: F403
