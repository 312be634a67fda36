"""The transfer guard: a student that learned from a teacher is kept only where the teacher's knowledge
pays on the student's own held-out day.

A teacher worse than the student's labels (a domain FM trained on little data, a foundation model that
never learned the vertical well) pulls the student toward its errors, and the loss on the training days
cannot tell. The newest training day, held out for early stopping, can: the student trained alone on the
same days and the transferred student are compared there by their validation NE at the steps they kept,
and the lower one serves.
"""

from __future__ import annotations

import math


def keep_transfer(transfer_validation_ne: float, alone_validation_ne: float) -> bool:
    """True unless the alone model's validation NE is lower (an unmeasured NE keeps the transfer)."""
    if math.isnan(transfer_validation_ne) or math.isnan(alone_validation_ne):
        return True
    return transfer_validation_ne <= alone_validation_ne
