"""Small hand-made model inputs for block tests: jagged histories with empty and length-1 sequences."""

import numpy as np
import torch

from gem_ops.data.loader import SequenceBatch
from gem_ops.model.config import FeatureSpec

SPEC = FeatureSpec(
    surfaces=("feed", "reels", "search"),
    event_types=("ad_impression", "organic_view"),
    objectives=("click", "conversion"),
    sparse_features=("user_segment", "item_category"),
    dense_features=("item_bid",),
    history_item_features=("item_category",),
)


def random_batch(history_lengths: list[int], seed: int = 0, spec: FeatureSpec = SPEC) -> SequenceBatch:
    g = torch.Generator().manual_seed(seed)
    B, N = len(history_lengths), sum(history_lengths)
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(history_lengths)]), dtype=torch.int64)
    labels = torch.randint(0, 2, (B, len(spec.objectives)), generator=g).float()
    mask = torch.ones(B, len(spec.objectives), dtype=torch.bool)
    mask[::3, 1] = False  # some examples have no conversion label
    return SequenceBatch(
        example_index=torch.arange(B),
        timestamp=torch.full((B,), 10**12),
        user_id=torch.randint(0, 10**9, (B,), generator=g),
        item_id=torch.randint(0, 10**6, (B,), generator=g),
        surface=torch.randint(0, len(spec.surfaces), (B,), generator=g),
        sparse_features={n: torch.randint(0, 50, (B,), generator=g) for n in spec.sparse_features},
        dense_features=torch.rand(B, len(spec.dense_features), generator=g) * 10,
        labels=labels * mask,
        label_mask=mask,
        history_offsets=offsets,
        history_item_id=torch.randint(0, 10**6, (N,), generator=g),
        history_surface=torch.randint(0, len(spec.surfaces), (N,), generator=g),
        history_event_type=torch.randint(0, len(spec.event_types), (N,), generator=g),
        history_action=torch.randint(0, 1 << len(spec.objectives), (N,), generator=g),
        history_age_seconds=torch.rand(N, generator=g) * 1e6,
        history_item_features={n: torch.randint(-1, 50, (N,), generator=g) for n in spec.history_item_features},
    )


def take(batch: SequenceBatch, rows: list[int]) -> SequenceBatch:
    """The examples at `rows` as their own batch."""
    offsets = batch.history_offsets
    positions = (torch.cat([torch.arange(int(offsets[r]), int(offsets[r + 1])) for r in rows]) if rows
                 else torch.zeros(0, dtype=torch.long))
    lengths = torch.tensor([int(offsets[r + 1] - offsets[r]) for r in rows])
    values = {}
    for name, value in batch.__dict__.items():
        if name == "history_item_features":
            values[name] = {k: v[positions] for k, v in value.items()}
        elif name.startswith("history_") and name != "history_offsets":
            values[name] = value[positions]
        elif name == "sparse_features":
            values[name] = {k: v[rows] for k, v in value.items()}
        elif name != "history_offsets":
            values[name] = None if value is None else value[rows]
    return SequenceBatch(**values, history_offsets=torch.nn.functional.pad(lengths.cumsum(0), (1, 0)))
