"""Synthetic training sets for model tests (the generator's STRONG_SIGNAL preset by default).

GEM_TEST_DATA_CACHE (a folder): data prepared once is kept there under a hash of its arguments and of the data
package's source, and read back with no polars. The GPU machine has no polars and no room to carry it: its tests
read what a run here prepared (`GEM_TEST_DATA_CACHE=.gpu_data/test_data pytest tests/test_step_readout.py` here,
then the GPU test there with the same setting)."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from datetime import date
from pathlib import Path

from gem_ops.data.loader import TrainingData


def learnable_data(root: Path, synthetic=None, days: int = 14, eval_days: int = 2, max_history_len: int = 256,
                   sub_batch_size: int = 64, **changes) -> TrainingData:
    """`synthetic` (a SyntheticConfig; STRONG_SIGNAL by default) with `changes` to its fields, prepared under `root`
    (or found in GEM_TEST_DATA_CACHE)."""
    cache = os.environ.get("GEM_TEST_DATA_CACHE")
    if not cache:
        return _prepare(root, synthetic, days, eval_days, max_history_len, sub_batch_size, changes)
    arguments = (repr(synthetic), sorted(changes.items()), days, eval_days, max_history_len, sub_batch_size,
                 _data_code_hash())
    kept = Path(cache) / hashlib.sha256(repr(arguments).encode()).hexdigest()[:16]
    if not kept.is_dir():
        kept.parent.mkdir(parents=True, exist_ok=True)
        aside = Path(tempfile.mkdtemp(dir=kept.parent, prefix=f".{kept.name}."))
        try:
            _prepare(aside, synthetic, days, eval_days, max_history_len, sub_batch_size, changes)
            aside.rename(kept)
        finally:
            shutil.rmtree(aside, ignore_errors=True)
    return TrainingData.at(kept)


def _data_code_hash() -> str:
    """The data package's source: a change to how data is generated or prepared leaves what a cache holds behind."""
    digest = hashlib.sha256()
    for path in sorted((Path(__file__).resolve().parents[1] / "gem_ops" / "data").glob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _prepare(root: Path, synthetic, days: int, eval_days: int, max_history_len: int, sub_batch_size: int,
             changes: dict) -> TrainingData:
    # Imported here: they need polars, which reading prepared data does not.
    import dataclasses

    from gem_ops.data.batch_shuffling import ShufflingConfig
    from gem_ops.data.prepare import prepare_training_data
    from gem_ops.data.raw_event_logs import EventSource
    from gem_ops.data.sequence_logs import SequenceLogsConfig
    from gem_ops.data.synthetic import STRONG_SIGNAL

    synthetic = dataclasses.replace(synthetic or STRONG_SIGNAL, **changes)
    return prepare_training_data(
        EventSource("synthetic", synthetic), date(2026, 11, days), days, root,
        SequenceLogsConfig(max_history_len=max_history_len, eval_days=eval_days),
        ShufflingConfig(sub_batch_size=sub_batch_size, sub_batches_per_rank=4), world_sizes=(1,),
    )
