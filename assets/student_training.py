"""Run config shared by the assets that train students (domain foundation models, vertical models)."""

from pydantic import Field

from assets.model_training import ModelTrainingConfig
from gem_ops.data.batch_shuffling import ShufflingConfig
from gem_ops.transfer.config import TransferConfig


class StudentTrainingConfig(ModelTrainingConfig):
    preset: str = Field("vertical", description="Model preset of the student (domain_fm, vertical, ...).")
    domains: list[str] = Field(default_factory=list, description="Domains (surfaces) to train; empty: every domain.")
    sub_batch_size: int = 128
    sub_batches_per_rank: int = Field(4, description="A step's batch is sub_batches_per_rank x sub_batch_size "
                                      "examples.")
    distillation_weight: float = Field(TransferConfig.distillation_weight, description="Weight of the loss on the "
                                       "teacher's targets against the labels'; 0: none.")
    distillation_head: str = Field(
        "serving", description="serving: the serving head learns the teacher's targets beside the true labels (soft "
        "targets); auxiliary: a head of its own learns them.")
    student_adapter: bool = Field(True, description="Map teacher logits to fresh-label-calibrated targets first.")
    adapter_feature: str = Field(
        "", description="A candidate sparse feature (e.g. item_category) whose values the Student Adapter shifts one "
        "by one: corrects a teacher whose days missed a shift of whole categories; empty: none.")
    adapter_fit: str = Field(
        "fresh", description="Which fresh labels the Student Adapter fits: fresh (the student's days, validation days "
        "included) or held_out (only the validation days, which the student does not train on).")
    adapter_shift_only: bool = Field(
        False, description="The Student Adapter shifts the teacher's logits per domain (and per adapter_feature value) "
        "only: the targets rank as the teacher does within each.")
    adapter_hidden: int = Field(TransferConfig.adapter_hidden, description="Hidden width of the Student Adapter's MLP.")
    adapter_steps: int = Field(TransferConfig.adapter_steps, description="Full-batch Adam steps fitting the Student "
                               "Adapter on the student's days.")
    adapter_lr: float = TransferConfig.adapter_lr
    adapter_feature_buckets: int = Field(TransferConfig.adapter_feature_buckets, description="Hash buckets of "
                                         "adapter_feature's values (one shift each).")
    adapter_shrinkage: bool = Field(
        TransferConfig.adapter_shrinkage, description="A Gaussian prior pulls the Student Adapter towards the "
        "identity, weighed against each task's labels (for students of few labels).")
    representation: bool = Field(True, description="The teacher's trunk representation is a student input.")
    shared_tables: list[str] = Field(["item"], description="Embedding tables initialised from the teacher.")
    shared_table_training: str = Field(
        "auto", description="fixed: the shared tables stay the teacher's (only their projection learns); trained: they "
        "learn on the student's days too; auto: both, keeping the student with the lower validation NE.")

    def transfer(self) -> TransferConfig:
        """TransferConfig's fields of the same names, freeze_shared from shared_table_training."""
        same = {name: getattr(self, name) for name in TransferConfig.__dataclass_fields__
                if name in type(self).model_fields}
        return TransferConfig(**{**same, "shared_tables": tuple(self.shared_tables),
                                 "freeze_shared": self.freeze_shared()})

    def freeze_shared(self) -> bool | str:
        modes = {"fixed": True, "trained": False, "auto": "auto"}
        if self.shared_table_training not in modes:
            raise ValueError(f"shared_table_training must be one of {list(modes)}, got {self.shared_table_training!r}")
        return modes[self.shared_table_training]

    def shuffling(self) -> ShufflingConfig:
        return ShufflingConfig(self.sub_batch_size, self.sub_batches_per_rank, seed=self.seed)

    def student_settings(self) -> dict:
        """The StudentSettings fields (gem_ops.transfer.config) this config sets."""
        return {"base": self.model(), "train": self.train(), "transfer": self.transfer(), "shuffling": self.shuffling()}

    def selected(self, domains) -> list[str]:
        unknown = sorted(set(self.domains) - set(domains))
        if unknown:
            raise ValueError(f"config domains {unknown} are not surfaces of the data {list(domains)}")
        return [d for d in domains if not self.domains or d in self.domains]
