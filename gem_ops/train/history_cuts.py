"""Training on cut histories: a share of each step's examples read only their most recent events.

A server under a compute budget scores with histories cut to a cap (gem_ops.serving.adaptive); a model
that only ever trained on whole histories meets those cuts for the first time there. Cutting a share of
the training histories to random lengths (log-uniform, so short cuts are as common as long ones per
octave) teaches it every length it will be asked to score.
"""

from __future__ import annotations

import numpy as np

_STREAM = 0x48_43  # "HC": the cuts' own random stream, apart from the plan's and the model's


def history_caps(n: int, max_history_len: int, share: float, seed: int, step: int) -> np.ndarray | None:
    """Per example of a step's n: the most history events it reads (max_history_len where not cut), the
    same for the same (seed, step) however the run was interrupted; None when nothing is cut."""
    if share <= 0:
        return None
    rng = np.random.default_rng([seed, _STREAM, step])
    caps = np.full(n, max_history_len, dtype=np.int64)
    cut = rng.random(n) < share
    drawn = np.exp(rng.uniform(0.0, np.log(max_history_len + 1), int(cut.sum())))
    caps[cut] = np.clip(np.floor(drawn).astype(np.int64), 1, max_history_len)
    return caps
