"""Settings of a teacher -> student transfer and of the data windows it uses."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from gem_ops.data.batch_shuffling import ShufflingConfig
    from gem_ops.model.config import ModelConfig
    from gem_ops.train.config import TrainConfig

Mode = Literal["alone", "direct", "hierarchical"]
MODES: tuple[str, ...] = ("alone", "direct", "hierarchical")
# Domain FMs learn from every day of their domain, labels aplenty: their teacher's targets weigh as much as the labels
# (the weight their figures were measured at); the verticals take TransferConfig's default.
FM_DISTILLATION_WEIGHT = 1.0


@dataclass(frozen=True)
class TransferConfig:
    # Weight of the loss on the teacher's targets against the labels' (0: no distillation). At 4, students of one fresh
    # day gained up to 0.07 AUC over weight 1 and students of four days were level with it, on both logs, 3 seeds
    # each (benchmarks/README.md): the targets keep a student of few labels from overfitting them.
    distillation_weight: float = 4.0
    # serving: the serving head learns the teacher's targets beside the labels (soft targets); auxiliary: a
    # head of its own learns them. Serving is ahead on every synthetic vertical (benchmarks/README.md).
    distillation_head: str = "serving"
    student_adapter: bool = True  # map teacher logits to fresh-label-calibrated targets first
    adapter_hidden: int = 16
    adapter_steps: int = 300  # full-batch Adam steps on the student's training window
    adapter_lr: float = 0.02
    # A candidate column (e.g. "item_category") whose values the adapter shifts one by one, hashed into
    # adapter_feature_buckets: corrects a teacher whose days missed a shift of whole categories ("": none).
    adapter_feature: str = ""
    adapter_feature_buckets: int = 64
    # A Gaussian prior on the whole adapter's departure from the identity, weighed against each task's labels.
    adapter_shrinkage: bool = False
    # Shifts only (per domain, and per feature value with adapter_feature): the teacher's logit keeps its scale and no
    # MLP reads it, so the targets rank within a domain as the teacher does.
    adapter_shift_only: bool = False
    # Which fresh labels the adapter fits: "fresh", every fresh example (the student's days, validation days
    # included); "held_out", only the student's validation days, so that the targets it trains on are not
    # fitted to the very labels it learns beside them (the student's training days without validation days).
    adapter_fit: Literal["fresh", "held_out"] = "fresh"
    representation: bool = True  # the teacher's trunk representation becomes a student input token
    shared_tables: tuple[str, ...] = ("item",)  # embedding tables copied from the teacher; () for none
    # True: the copied tables stay the teacher's, only their projection learns; False: they train on the student's
    # days too; "auto": both, keeping the student with the lower validation NE (fixed without validation days).
    # Neither is better everywhere: fixed, the synthetic log's direct students closed 0.81-0.97 of the click gaps
    # instead of 0.56-0.78 (8 seeds); on MovieLens trained tables were ahead by up to 0.03 AUC (benchmarks/README.md).
    freeze_shared: bool | Literal["auto"] = "auto"

    def __post_init__(self):
        if self.freeze_shared not in (True, False, "auto"):
            raise ValueError(f"TransferConfig.freeze_shared must be true, false or 'auto', got {self.freeze_shared!r}")
        if self.adapter_fit not in ("fresh", "held_out"):
            raise ValueError(f"TransferConfig.adapter_fit must be 'fresh' or 'held_out', got {self.adapter_fit!r}")
        if self.distillation_weight < 0:
            raise ValueError(f"TransferConfig.distillation_weight must be >= 0, got {self.distillation_weight}")
        if self.adapter_steps < 1 or self.adapter_hidden < 1 or self.adapter_feature_buckets < 1:
            raise ValueError("TransferConfig.adapter_steps, adapter_hidden and adapter_feature_buckets must be >= 1")

    @property
    def uses_predictions(self) -> bool:
        return self.distillation_weight > 0 or self.representation

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class TransferWindows:
    """Which training days the teacher and the students learn from (the eval split is the same for all).

    The students train on the newest `student_days` days of the training split; the teacher's data ends
    `staleness_days` before the students' does (a foundation model retrains less often than the models
    that serve, so its supervision is stale). A domain FM learns from its domain's newest `domain_fm_days`
    days (None: every training day; never fewer than the students'): trained on the students' few days
    only, an FM larger than they are is no better teacher than their own labels."""

    student_days: int = 3
    staleness_days: int = 0
    domain_fm_days: int | None = None

    def __post_init__(self):
        if self.student_days < 1 or self.staleness_days < 0:
            raise ValueError(f"TransferWindows: student_days must be >= 1 and staleness_days >= 0, "
                             f"got {self.student_days} and {self.staleness_days}")
        if self.domain_fm_days is not None and self.domain_fm_days < self.student_days:
            raise ValueError(f"TransferWindows: domain_fm_days ({self.domain_fm_days}) must be None (every training "
                             f"day) or at least student_days ({self.student_days})")

    @classmethod
    def of_teacher(cls, identity: dict[str, Any]) -> TransferWindows:
        """The windows a teacher's stored predictions were scored for (their identity records them)."""
        return cls(student_days=identity["student_days"], domain_fm_days=identity.get("domain_fm_days"))


@dataclass(frozen=True)
class StudentSettings:
    """What every student model (domain FM, vertical model) trains with."""

    base: ModelConfig  # the student's architecture (its transfer inputs are added from `transfer`)
    train: TrainConfig
    transfer: TransferConfig
    shuffling: ShufflingConfig
