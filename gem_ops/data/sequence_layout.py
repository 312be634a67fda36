"""The on-disk layout of a sequence_logs folder, shared by its writer and its readers (readers need
only pyarrow, so training runs where polars is not installed)."""

from __future__ import annotations

import json
import os
from pathlib import Path

TIMELINE_FIELDS = ("item_id", "timestamp", "surface", "event_type", "action")
MANIFEST = "manifest.json"
TIMELINES = "timelines"
EXAMPLES = "examples"
# One row per item: item_id and the item's sparse features (item_<name> integer columns), its last
# values in the input; the loader gives every history event its item's features from it.
ITEMS = "items.parquet"
ITEM_FEATURE_PREFIX = "item_"


def retrieval_keys(history_item_features, sparse_features) -> tuple[str, ...]:
    """What retrieved history may match a candidate on: its item, or an item feature that both the candidate
    (sparse_features) and every history event (history_item_features) carry."""
    return ("item", *(f for f in history_item_features if f in sparse_features))


def read_manifest(path: str | os.PathLike) -> dict:
    return json.loads((Path(path) / MANIFEST).read_text())
