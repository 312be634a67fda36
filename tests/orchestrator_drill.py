"""`python -m tests.orchestrator_drill ARGS`: `python -m pipelines.run_local ARGS` that stops for good in the
middle of writing sequence_logs (its files written aside, the partition not yet renamed into place), after
touching the file GEM_DRILL_MARKER, so that a test can kill it there."""

import os
import sys
import time
from pathlib import Path

from gem_ops.data import sequence_logs
from pipelines.run_local import main

_write_items = sequence_logs._write_items


def _write_items_then_stall(*args, **kwargs):
    written = _write_items(*args, **kwargs)
    Path(os.environ["GEM_DRILL_MARKER"]).write_text(str(os.getpid()))
    time.sleep(3600)
    return written


if __name__ == "__main__":
    sequence_logs._write_items = _write_items_then_stall
    sys.exit(main())
