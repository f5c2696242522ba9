"""``python -m ampkit ...`` (and ``torchrun -m ampkit train ...``)."""

import sys

from .cli import main

sys.exit(main())
