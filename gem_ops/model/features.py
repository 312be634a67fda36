"""A loader batch as model input: TorchRec KeyedJaggedTensors for ids, tensors for the rest.

Ids of any range are hashed into their tables' rows; times between an event and its request become
log2 buckets. The candidate item and the history items are two features of one table.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gem_ops.data.loader import SequenceBatch
from gem_ops.model import jagged
from gem_ops.model.config import FeatureSpec, ModelConfig

USER_ID = "user_id"
SURFACE = "surface"
CANDIDATE_ITEM = "candidate_item"
HISTORY_ITEM = "history_item"
HISTORY_SURFACE = "history_surface"
HISTORY_EVENT_TYPE = "history_event_type"
HISTORY_ACTION = "history_action"
HISTORY_AGE = "history_age"
HISTORY_MATCH = "history_match"  # 1 where the history event's item is the candidate item
SEQUENCE_KEYS = (CANDIDATE_ITEM, HISTORY_ITEM, HISTORY_SURFACE, HISTORY_EVENT_TYPE, HISTORY_ACTION, HISTORY_AGE,
                 HISTORY_MATCH)


def history_features(spec: FeatureSpec, config: ModelConfig) -> tuple[str, ...]:
    """The item features the model's history tokens carry."""
    return spec.history_item_features if config.history_item_features else ()


def sequence_keys(spec: FeatureSpec, config: ModelConfig) -> tuple[str, ...]:
    """Per history item feature f, besides the base keys: the event's item's f (history_f) and whether it
    equals the candidate's (history_f_match): "this user watched items of the candidate's category" in
    one lookup."""
    return (*SEQUENCE_KEYS, *(k for f in history_features(spec, config)
                              for k in (f"history_{f}", f"history_{f}_match")))

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64: a multiplicative hash spreading id patterns


def hash_ids(ids: torch.Tensor, buckets: int) -> torch.Tensor:
    h = ids.long() * _GOLDEN
    return (h ^ (h >> 31)).remainder(buckets)


def age_bucket(age_seconds: torch.Tensor, buckets: int) -> torch.Tensor:
    return torch.log2(1.0 + age_seconds.clamp(min=0)).long().clamp(max=buckets - 1)


def pooled_keys(spec: FeatureSpec) -> tuple[str, ...]:
    return (USER_ID, *spec.sparse_features, SURFACE)


@dataclass
class ModelInput:
    pooled: KeyedJaggedTensor  # one id per example for each of pooled_keys(spec)
    sequence: KeyedJaggedTensor  # SEQUENCE_KEYS: the candidate (1 per example) and the jagged history
    dense: torch.Tensor  # [B, n_dense], signed log1p
    surface: torch.Tensor  # [B] domain id
    history_offsets: torch.Tensor  # [B + 1]
    history_action: torch.Tensor  # [N] raw bitmask, for branch selection
    history_event_type: torch.Tensor  # [N]
    labels: torch.Tensor  # [B, T] the model's tasks (ModelConfig.objectives)
    label_mask: torch.Tensor  # [B, T]
    teacher_representation: torch.Tensor | None = None  # [B, H] representation transfer
    teacher_logits: torch.Tensor | None = None  # [B, T] distillation targets (adapted teacher logits)
    # Per sequence branch, its history tokens at every level of the pyramid (jagged.level_totals), counted on the
    # host where the batch was built: a forward then never waits to read them back from the device.
    level_sizes: list[list[int]] | None = None
    # Sizes bucketed (model_input's size_bucket): level_sizes and the history events' count (history_action's,
    # history_event_type's and the history tokens' rows) are capacities, rows past the last sequence no example's.
    padded: bool = False

    @property
    def size(self) -> int:
        return int(self.surface.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> ModelInput:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return ModelInput(**{k: v.to(device, non_blocking=non_blocking) if _movable(v) else v
                             for k, v in moved.items()})

    def pin_memory(self) -> ModelInput:
        """In page-locked host memory, so that a copy to the GPU with non_blocking=True is asynchronous."""
        return ModelInput(**{f.name: v.pin_memory() if _movable(v := getattr(self, f.name)) else v
                             for f in fields(self)})


def _movable(value) -> bool:
    return isinstance(value, (torch.Tensor, KeyedJaggedTensor))


def check_branch(name: str, spec: FeatureSpec) -> None:
    event_type = name.split(":", 1)[1] if name.startswith("event_type:") else None
    if name not in ("all", "engaged") and event_type not in spec.event_types:
        raise ValueError(f"unknown sequence branch {name!r}: use 'all', 'engaged' or 'event_type:<name>' with one of "
                         f"{list(spec.event_types)}")


def branch_keep_mask(name: str, spec: FeatureSpec, history_action: torch.Tensor,
                     history_event_type: torch.Tensor) -> torch.Tensor | None:
    """[N] the history events sequence branch `name` reads (None: all of them)."""
    check_branch(name, spec)
    if name == "all":
        return None
    if name == "engaged":
        return history_action != 0
    return history_event_type == spec.event_types.index(name.split(":", 1)[1])


def branch_lengths(x: ModelInput, spec: FeatureSpec, names) -> tuple[list[torch.Tensor | None], torch.Tensor]:
    """Per sequence branch: its keep mask [N] (None: every event) and each example's kept length, stacked [S, B]."""
    keeps = [branch_keep_mask(name, spec, x.history_action, x.history_event_type) for name in names]
    lengths = torch.stack([jagged.lengths_of(x.history_offsets) if keep is None
                           else jagged.kept_lengths(x.history_offsets, keep, x.padded) for keep in keeps])
    return keeps, lengths


def bucketed(n: int, ratio: float, quantum: int = 64) -> int:
    """The smallest size of the ladder quantum, then each step `ratio` times the last (rounded up to a multiple of
    quantum), that holds n: at 1.05, 10-20 sizes between 130,000 and 280,000 tokens."""
    if ratio <= 1:
        raise ValueError(f"size bucket ratio must be > 1, got {ratio}")
    size = quantum
    while size < n:  # at least a quantum up each step: a ratio near 1 still climbs
        size = max(size + quantum, -(-int(size * ratio) // quantum) * quantum)
    return size


def _padded_events(values: torch.Tensor, capacity: int, fill: int) -> torch.Tensor:
    return torch.cat([values, values.new_full((capacity - values.numel(),), fill)])


def level_sizes(x: ModelInput, spec: FeatureSpec, config: ModelConfig) -> list[list[int]]:
    """Each sequence branch's history tokens at every level of its pyramid (where x lives: on the host, free)."""
    _, lengths = branch_lengths(x, spec, config.sequence.branches)
    return jagged.level_totals(lengths, [config.sequence.level_tokens(b) for b in range(config.blocks)])


def model_input(batch: SequenceBatch, spec: FeatureSpec, config: ModelConfig,
                with_level_sizes: bool = False, size_bucket: float = 0.0) -> ModelInput:
    """The model's input from a loader batch; `with_level_sizes` also counts the pyramid's level sizes on the host
    (for a training or eval loop that builds inputs on the CPU and moves them to a GPU; not for a traced export,
    which would take the counts for constants). `size_bucket` (> 1, with level sizes): every size the step after
    the lookups sees rounded up (bucketed), the history events' tensors padded with events no branch but "all"
    reads, past the last example's (ModelInput.padded)."""
    emb = config.embedding
    B = batch.size
    pooled_ids = [hash_ids(batch.user_id, emb.user_buckets)]
    pooled_ids += [hash_ids(batch.sparse_features[name], emb.sparse_buckets) for name in spec.sparse_features]
    pooled_ids.append(batch.surface.long())
    pooled = KeyedJaggedTensor.from_lengths_sync(
        keys=list(pooled_keys(spec)),
        values=torch.cat(pooled_ids),
        lengths=torch.ones(B * len(pooled_ids), dtype=torch.int32),
    )
    lengths = batch.history_lengths.to(torch.int32)
    candidate_per_event = torch.repeat_interleave(batch.item_id, batch.history_lengths,
                                                  output_size=batch.history_item_id.numel())
    history = [
        hash_ids(batch.history_item_id, emb.item_buckets),
        batch.history_surface,
        batch.history_event_type,
        batch.history_action.clamp(0, spec.n_actions - 1),
        age_bucket(batch.history_age_seconds, emb.age_buckets),
        # Target-aware: which past events were on this very item, however far back (a key the
        # candidate's attention can find in one step, where matching learnt embeddings takes many).
        (batch.history_item_id == candidate_per_event).long(),
    ]
    for name in history_features(spec, config):
        values = batch.history_item_features[name]
        candidate_value = torch.repeat_interleave(batch.sparse_features[name], batch.history_lengths,
                                                  output_size=values.numel())
        history += [hash_ids(values, emb.sparse_buckets), ((values == candidate_value) & (values >= 0)).long()]
    sequence = KeyedJaggedTensor.from_lengths_sync(
        keys=list(sequence_keys(spec, config)),
        values=torch.cat([hash_ids(batch.item_id, emb.item_buckets), *history]),
        lengths=torch.cat([torch.ones(B, dtype=torch.int32), *[lengths] * len(history)]),
    )
    dense = batch.dense_features
    columns = config.task_columns(spec)
    x = ModelInput(
        pooled=pooled,
        sequence=sequence,
        dense=torch.sign(dense) * torch.log1p(dense.abs()),
        surface=batch.surface.long(),
        history_offsets=batch.history_offsets,
        history_action=batch.history_action,
        history_event_type=batch.history_event_type,
        labels=batch.labels[:, columns],
        label_mask=batch.label_mask[:, columns],
        teacher_representation=_teacher_representation(batch, config),
        teacher_logits=None if batch.teacher_logits is None else batch.teacher_logits[:, columns],
    )
    if with_level_sizes and config.architecture == "gem" and config.use_sequence and config.sequence.branches:
        x.level_sizes = level_sizes(x, spec, config)
        if size_bucket:
            x.level_sizes = [[bucketed(n, size_bucket) for n in sizes] for sizes in x.level_sizes]
            capacity = bucketed(int(batch.history_offsets[-1]), size_bucket)  # the "all" tokens' own bucket
            x.history_action = _padded_events(x.history_action, capacity, 0)
            x.history_event_type = _padded_events(x.history_event_type, capacity, -1)
            x.padded = True
    return x


def _teacher_representation(batch: SequenceBatch, config: ModelConfig) -> torch.Tensor | None:
    if not config.teacher_representation_dim:
        return None
    rep = batch.teacher_representation
    if rep is None or rep.shape[-1] != config.teacher_representation_dim:
        got = "none" if rep is None else f"width {rep.shape[-1]}"
        raise ValueError(f"the model takes a teacher representation of width {config.teacher_representation_dim}, "
                         f"the batch has {got}: join the teacher's predictions (gem_ops.transfer.TeacherJoinedLogs)")
    return rep.float()
