"""The serving request: one user on one surface, their history (most recent event last) and N candidates,
as plain tensors in a fixed order, so that an exported program and a client without this library agree.

A request is what the pyfunc's table holds as N rows that repeat the same user, surface, history and
representation: request_batch writes it that way, so both are scored on the same inputs."""

from __future__ import annotations

from dataclasses import replace

import torch

from gem_ops.data.loader import SequenceBatch
from gem_ops.model.config import FeatureSpec
from gem_ops.serving.client import HISTORY_FIELDS

# Name -> (dtype, shape in words); the exported program takes them positionally in this order.
REQUEST_INPUTS: dict[str, tuple[torch.dtype, str]] = {
    "surface": (torch.int64, "[] the request's surface (domain) id"),
    "user_id": (torch.int64, "[1]"),
    "item_id": (torch.int64, "[N] candidate items"),
    "sparse_features": (torch.int64, "[N, S] each candidate's sparse ids, in the spec's sparse_features order"),
    "dense_features": (torch.float32, "[N, D] raw dense features, in the spec's dense_features order"),
    "history_item_id": (torch.int64, "[L]"),
    "history_surface": (torch.int64, "[L] surface ids"),
    "history_event_type": (torch.int64, "[L] event type ids"),
    "history_action": (torch.int64, "[L] bitmask of the event's positive labels"),
    "history_age_seconds": (torch.float32, "[L] request time minus event time"),
    "history_item_features": (torch.int64, "[L, F] the events' item features, in history_item_features order"),
    "representation": (torch.float32, "[H] the looked-up user representation (H 0 without one)"),
}
# A model with sequence.retrieved_events K > 0 takes these after them: each candidate's retrieved events.
RETRIEVED_REQUEST_INPUTS: dict[str, tuple[torch.dtype, str]] = {
    **{f"retrieved_{f}": (REQUEST_INPUTS[f"history_{f}"][0], "[N, K, F]" if f == "item_features" else "[N, K]")
       for f in HISTORY_FIELDS},
    "retrieved_count": (torch.int64, "[N] how many of each candidate's K slots hold an event, oldest first (the "
                        "rest: padding)"),
}


def request_inputs(retrieved_events: int) -> dict[str, tuple[torch.dtype, str]]:
    """The inputs of a request to a model with `retrieved_events` (its sequence.retrieved_events), in order."""
    return {**REQUEST_INPUTS, **(RETRIEVED_REQUEST_INPUTS if retrieved_events else {})}


def request_of_example(batch: SequenceBatch, row: int, candidates: SequenceBatch | None = None,
                       history_cap: int | None = None) -> dict[str, torch.Tensor]:
    """The request of example `row` of `batch` (its user, surface, history and representation), with the
    candidates of `candidates` (default: the example's own item); history cut to its most recent
    `history_cap` events."""
    candidates = candidates or _rows(batch, [row])
    start, end = int(batch.history_offsets[row]), int(batch.history_offsets[row + 1])
    if history_cap is not None:
        start = max(start, end - history_cap)
    history = slice(start, end)
    rep = batch.teacher_representation
    spec_sparse = list(candidates.sparse_features)
    return {
        "surface": batch.surface[row].long(),
        "user_id": batch.user_id[row : row + 1].long(),
        "item_id": candidates.item_id.long(),
        "sparse_features": (torch.stack([candidates.sparse_features[n].long() for n in spec_sparse], 1) if spec_sparse
                            else torch.zeros(candidates.size, 0, dtype=torch.int64)),
        "dense_features": candidates.dense_features.float(),
        "history_item_id": batch.history_item_id[history].long(),
        "history_surface": batch.history_surface[history].long(),
        "history_event_type": batch.history_event_type[history].long(),
        "history_action": batch.history_action[history].long(),
        "history_age_seconds": batch.history_age_seconds[history].float(),
        "history_item_features": (torch.stack([v[history].long() for v in batch.history_item_features.values()], 1)
                                  if batch.history_item_features else torch.zeros(end - start, 0, dtype=torch.int64)),
        "representation": rep[row].float() if rep is not None else torch.zeros(0),
    }


def request_batch(request: dict[str, torch.Tensor], spec: FeatureSpec) -> SequenceBatch:
    """The request as a loader batch of N examples sharing the user, surface, history and representation
    (each candidate's retrieved events first, when the request has them)."""
    n, length = request["item_id"].shape[0], request["history_item_id"].shape[0]
    if "retrieved_count" in request:
        return _with_retrieved(request, spec)
    repeat = lambda key: request[key].repeat(n)  # noqa: E731
    rep = request["representation"]
    return SequenceBatch(
        example_index=torch.arange(n), timestamp=torch.zeros(n, dtype=torch.int64),
        user_id=request["user_id"].expand(n).clone(), item_id=request["item_id"],
        surface=request["surface"].expand(n).clone(),
        sparse_features={name: request["sparse_features"][:, i] for i, name in enumerate(spec.sparse_features)},
        dense_features=request["dense_features"], labels=torch.zeros(n, len(spec.objectives)),
        label_mask=torch.zeros(n, len(spec.objectives), dtype=torch.bool),
        history_offsets=torch.arange(n + 1) * length,
        history_item_id=repeat("history_item_id"), history_surface=repeat("history_surface"),
        history_event_type=repeat("history_event_type"), history_action=repeat("history_action"),
        history_age_seconds=repeat("history_age_seconds"),
        teacher_representation=rep.expand(n, -1).clone() if rep.numel() else None,
        history_item_features={name: request["history_item_features"][:, i].repeat(n)
                               for i, name in enumerate(spec.history_item_features)},
    )


def _rows(batch: SequenceBatch, rows: list[int]) -> SequenceBatch:
    """The candidate side (item, sparse and dense features) of some examples; no history."""
    index = torch.tensor(rows)
    empty = torch.zeros(0, dtype=torch.int64)
    return SequenceBatch(
        example_index=batch.example_index[index], timestamp=batch.timestamp[index], user_id=batch.user_id[index],
        item_id=batch.item_id[index], surface=batch.surface[index],
        sparse_features={k: v[index] for k, v in batch.sparse_features.items()},
        dense_features=batch.dense_features[index], labels=batch.labels[index], label_mask=batch.label_mask[index],
        history_offsets=torch.zeros(len(rows) + 1, dtype=torch.int64), history_item_id=empty, history_surface=empty,
        history_event_type=empty, history_action=empty, history_age_seconds=empty.float())


def _with_retrieved(request: dict[str, torch.Tensor], spec: FeatureSpec) -> SequenceBatch:
    """request_batch of a request with retrieved events: candidate i's history is its retrieved_count[i]
    retrieved events, then the request's history."""
    count = request["retrieved_count"].long()
    n, k, length = count.shape[0], request["retrieved_item_id"].shape[1], request["history_item_id"].shape[0]
    slots = torch.arange(k).unsqueeze(0) < count.unsqueeze(1)  # [N, K]

    def per_candidate(field: str) -> torch.Tensor:
        retrieved, recent = request[f"retrieved_{field}"], request[f"history_{field}"]
        recent = recent.unsqueeze(0).expand(n, *recent.shape)
        # Row-major [N, K + L] with the unused slots dropped: each candidate's events back to back.
        return torch.cat([retrieved, recent], 1)[torch.cat([slots, slots.new_ones(n, length)], 1)]

    batch = request_batch({key: value for key, value in request.items() if not key.startswith("retrieved_")}, spec)
    events = {f: per_candidate(f) for f in HISTORY_FIELDS}
    offsets = torch.zeros(n + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(count + length, 0)
    return replace(batch, history_offsets=offsets, retrieved_lengths=count,
                   **{f"history_{f}": events[f] for f in HISTORY_FIELDS if f != "item_features"},
                   history_item_features={name: events["item_features"][:, i]
                                          for i, name in enumerate(spec.history_item_features)})
