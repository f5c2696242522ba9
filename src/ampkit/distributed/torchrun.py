"""``python -m ampkit.distributed.torchrun``: PyTorch's torchrun, ending quietly on a signal.

torchrun answers SIGINT/SIGTERM by stopping its workers (with the same signal) and then lets its
``SignalException`` escape as a traceback. The workers' own message (the step they stopped
after, the checkpoint, the resume command) is the one that matters, so this entry point runs
torchrun unchanged and turns that exception into the exit status ``128 + signal``.
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main


def run() -> int:
    try:
        main()
    except SignalException as e:
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(run())
