"""Scores serving requests with an exported vertical model: needs only torch (this file is copied into every
serving artifact as serving_client.py, so it runs where the project's code is not installed).

    from serving_client import ServingClient
    client = ServingClient("path/to/serving")  # the folder: serving.json and the programs it names
    scores = client.score(request)  # {"p_click": tensor [N], ...}

A request is a dict of tensors (serving.json's "inputs" lists names, dtypes and shapes): one user's surface,
history (most recent event last) and looked-up representation, and N candidates with their features. A model
trained with retrieved events (serving.json's "retrieved_events" K > 0) also takes, per candidate, up to K older
events of the candidate's own item from beyond the history sent: `retrieve` finds them in a longer history.
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

    def retrieve(self, request: dict[str, torch.Tensor], history_cap: int | None = None) -> dict[str, torch.Tensor]:
        """The request (its history the user's whole, or as much of it as known) cut to its `history_cap` most
        recent events, with each candidate's retrieved older events as this artifact's model takes them."""
        manifest = self.manifest
        return retrieve(request, manifest.get("retrieved_events", 0), manifest["max_history_len"], history_cap,
                        retrieval_columns(manifest.get("retrieval_key", "item"), manifest["history_item_features"],
                                          manifest["sparse_features"]))

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


HISTORY_FIELDS = ("item_id", "surface", "event_type", "action", "age_seconds", "item_features")
# Per candidate: its retrieved events [N, K] (slots from retrieved_count on are padding), oldest first.
RETRIEVED_INPUTS = (*(f"retrieved_{f}" for f in HISTORY_FIELDS), "retrieved_count")
CANDIDATE_INPUTS = ("item_id", "sparse_features", "dense_features", *RETRIEVED_INPUTS)


def retrieval_columns(key: str, history_item_features: list[str], sparse_features: list[str]) -> tuple[int, int] | None:
    """Where a retrieval key sits in a request: None for the candidate's item, else (its column in
    history_item_features, in sparse_features)."""
    # (gem_ops.data.sequence_layout.retrieval_keys' rule, restated: this client loads without the project's code)
    if key != "item" and (key not in history_item_features or key not in sparse_features):
        raise ValueError(f"retrieval key {key!r} is not among the request's history item features "
                         f"{history_item_features} and sparse features {sparse_features}")
    return None if key == "item" else (history_item_features.index(key), sparse_features.index(key))


def retrieve(request: dict[str, torch.Tensor], retrieved_events: int, max_history_len: int,
             history_cap: int | None = None, key_columns: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """`request` with its history cut to the most recent min(history_cap, max_history_len) events and, for
    each candidate, the latest `retrieved_events` (K) older events that match it, oldest first, as
    retrieved_* [N, K] tensors (the hard search of retrieval-based long-history models; the training data's
    SequenceLogs.retrieve_matches). A match shares the candidate's item, or with `key_columns`
    (retrieval_columns) that item feature (an unknown value, -1, matches nothing). A server answers it from a
    per-user index; here it is a scan of the history the request holds."""
    history = {f: request[f"history_{f}"] for f in HISTORY_FIELDS}
    length = history["item_id"].shape[0]
    keep = min(length, max_history_len, length if history_cap is None else max(history_cap, 0))
    if key_columns is None:
        events, wanted = history["item_id"], request["item_id"]
    else:
        events, wanted = history["item_features"][:, key_columns[0]], request["sparse_features"][:, key_columns[1]]
        wanted = torch.where(wanted >= 0, wanted, torch.full_like(wanted, -2))  # unknown: no match
    older = events[: length - keep]
    match = older.unsqueeze(0) == wanted.unsqueeze(1)  # [N, older]
    from_end = match.flip(1).long().cumsum(1).flip(1)  # 1 at each candidate's latest match
    count = match.sum(1).clamp(max=retrieved_events)
    rows, columns = (match & (from_end <= retrieved_events)).nonzero(as_tuple=True)
    position = torch.zeros(match.shape[0], retrieved_events, dtype=torch.int64)
    position[rows, count[rows] - from_end[rows, columns]] = columns
    out = {k: v for k, v in request.items() if not k.startswith("retrieved_")}
    for f, values in history.items():
        out[f"history_{f}"] = values[length - keep :]
        padded = values[position] if older.numel() else values.new_zeros((*position.shape, *values.shape[1:]))
        out[f"retrieved_{f}"] = padded
    out["retrieved_count"] = count
    return out


def _load(path: Path, kind: str):
    if kind == "aot_inductor":
        return torch._inductor.aoti_load_package(str(path))
    if kind == "exported_program":
        return torch.export.load(str(path)).module()
    raise ValueError(f"unknown serving format {kind!r} in {MANIFEST}: exported_program or aot_inductor")
