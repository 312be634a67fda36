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


def read_manifest(path: str | os.PathLike) -> dict:
    return json.loads((Path(path) / MANIFEST).read_text())
