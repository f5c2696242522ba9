"""Moved to :mod:`ampkit.plan.depth` and :mod:`ampkit.plan.depth_plan` (issue 35); this path stays
for imports written before."""

from ..plan.depth import *  # noqa: F403
from ..plan.depth_plan import *  # noqa: F403
