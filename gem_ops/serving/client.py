"""Scores serving requests with an exported vertical model: needs only torch (this file is copied into every
serving artifact as serving_client.py, so it runs where the project's code is not installed).

    from serving_client import ServingClient
    client = ServingClient("path/to/serving")  # the folder: serving.json and the programs it names
    scores = client.score(request)  # {"p_click": tensor [N], ...}

A request is a dict of tensors (serving.json's "inputs" lists names, dtypes and shapes): one user's surface,
history (most recent event last) and looked-up representation, and N candidates with their features.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

MANIFEST = "serving.json"


class ServingClient:
    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        manifest = self.folder / MANIFEST
        if not manifest.exists():
            raise FileNotFoundError(f"{manifest} not found: not a serving artifact folder")
        self.manifest = json.loads(manifest.read_text())
        self.inputs = [spec["name"] for spec in self.manifest["inputs"]]
        self.outputs = list(self.manifest["outputs"])
        self.programs = {name: _load(self.folder / file, self.manifest["format"])
                         for name, file in self.manifest["programs"].items()}

    @torch.no_grad()
    def score(self, request: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each output's probabilities [N] for the request's N candidates."""
        missing = [name for name in self.inputs if name not in request]
        if missing:
            raise ValueError(f"request lacks {missing}; a request holds {self.inputs} (see {self.folder / MANIFEST})")
        args = [request[name] for name in self.inputs]
        n = args[self.inputs.index("item_id")].shape[0]
        if n == 0:
            return {name: torch.zeros(0) for name in self.outputs}
        # The programs take at least two candidates: one candidate is scored beside a copy of itself.
        if n == 1:
            args = [_twice(name, a) for name, a in zip(self.inputs, args)]
        history = args[self.inputs.index("history_item_id")].shape[0]
        program = self.programs.get(program_name(history), self.programs["default"])
        probabilities = program(*args)[:n]
        return {name: probabilities[:, i] for i, name in enumerate(self.outputs)}


def program_name(history_length: int) -> str:
    """The program traced for this one history length (where the default program does not serve it)."""
    return f"history_{history_length}"


def _twice(name: str, value: torch.Tensor) -> torch.Tensor:
    return torch.cat([value, value]) if name in CANDIDATE_INPUTS else value


CANDIDATE_INPUTS = ("item_id", "sparse_features", "dense_features")


def _load(path: Path, kind: str):
    if kind == "aot_inductor":
        return torch._inductor.aoti_load_package(str(path))
    if kind == "exported_program":
        return torch.export.load(str(path)).module()
    raise ValueError(f"unknown serving format {kind!r} in {MANIFEST}: exported_program or aot_inductor")
