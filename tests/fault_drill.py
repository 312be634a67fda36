"""`python -m tests.fault_drill ARGS`: `python -m gem_ops.train ARGS` with faults injected, for the
fault-tolerance tests (torchrun launches it in place of the production entry point).

GEM_TRAIN_FAIL_AT_STEP=k makes rank GEM_TRAIN_FAIL_RANK (default 1) exit with an error after step k on
a job's first attempt (TORCHELASTIC_RESTART_COUNT 0); GEM_TRAIN_STEP_DELAY_S adds a pause after every step.
"""

import os
import sys
import time

from gem_ops.train.__main__ import main


class FaultDrill:
    def __init__(self, rank: int):
        fail_at = os.environ.get("GEM_TRAIN_FAIL_AT_STEP")
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        failing_rank = int(os.environ.get("GEM_TRAIN_FAIL_RANK", "1"))
        self.fail_after = int(fail_at) if fail_at and first_attempt and rank == failing_rank else None
        self.delay = float(os.environ.get("GEM_TRAIN_STEP_DELAY_S", "0"))

    def __call__(self, step: int, loss: float) -> None:
        if self.delay:
            time.sleep(self.delay)
        if self.fail_after is not None and step + 1 == self.fail_after:
            raise RuntimeError(f"GEM_TRAIN_FAIL_AT_STEP: rank fails after step {step + 1} on purpose")


if __name__ == "__main__":
    sys.exit(main(step_hooks=[FaultDrill(int(os.environ.get("RANK", "0")))]))
