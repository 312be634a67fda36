"""Nothing the project loads runs code: crafted checkpoints and model files are refused, and the
library holds no unrestricted load."""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from gem_ops.train.checkpoint import DCP_METADATA, PROGRESS_FILE, load_checkpoint
from gem_ops.train.model_state import load_model_state

ROOT = Path(__file__).resolve().parents[1]


class _Payload:
    """Unpickling this runs a shell command: what a malicious file carries."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _checkpoint(folder: Path) -> Path:
    dcp.save({"model": {"w": torch.ones(3, 2)}}, checkpoint_id=folder)
    torch.save({"step": 7}, folder / PROGRESS_FILE)
    return folder


def test_a_real_checkpoint_loads(tmp_path):
    loaded = load_checkpoint(_checkpoint(tmp_path / "step_00000007"))
    assert loaded.step == 7 and torch.equal(loaded.state["model"]["w"], torch.ones(3, 2))


def test_crafted_checkpoint_metadata_is_refused_before_anything_runs(tmp_path):
    folder = _checkpoint(tmp_path / "step_00000007")
    marker = tmp_path / "ran"
    (folder / DCP_METADATA).write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(pickle.UnpicklingError,
                       match=r"\.metadata is not a safe checkpoint: it refers to (posix|os)\.system"):
        load_checkpoint(folder)
    assert not marker.exists()


def test_crafted_progress_or_model_file_is_refused(tmp_path):
    marker = tmp_path / "ran"
    folder = _checkpoint(tmp_path / "step_00000007")
    torch.save({"step": 7, "payload": _Payload(marker)}, folder / PROGRESS_FILE)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        load_checkpoint(folder)
    model_file = tmp_path / "model_state.pt"
    torch.save({"model": {}, "payload": _Payload(marker)}, model_file)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        load_model_state(model_file)
    assert not marker.exists()


def test_the_library_has_no_unrestricted_load():
    offending = []
    for path in [*ROOT.glob("gem_ops/**/*.py"), *ROOT.glob("assets/**/*.py"), *ROOT.glob("pipelines/**/*.py")]:
        text = path.read_text()
        for call in re.finditer(r"torch\.load\((?:[^()]|\([^()]*\))*\)", text):
            if "weights_only=True" not in call.group(0):
                offending.append(f"{path.relative_to(ROOT)}: {call.group(0)}")
        if re.search(r"weights_only\s*=\s*False|pickle\.loads?\(|\bdill\b", text):
            offending.append(f"{path.relative_to(ROOT)}: unrestricted unpickling")
    assert not offending, offending
