"""A student trained through the engine with distillation (Student Adapter) and a shared table, from a
teacher the engine trained too, takes the steps the old single-process loop took on the same seed: losses
and eval figures of tests/golden/student_distillation.json, recorded with that loop. (Representation
transfer is left out: it now reads a per-user, per-day table where the old loop read a per-example one.)"""

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from gem_ops.data.batch_shuffling import ShufflingConfig
from gem_ops.data.synthetic import STRONG_SIGNAL, SurfaceSpec
from gem_ops.model.config import model_config
from gem_ops.train.config import TrainConfig
from gem_ops.train.engine import train
from gem_ops.transfer import windows
from gem_ops.transfer.config import TransferConfig, TransferWindows
from gem_ops.transfer.knowledge import score_examples
from gem_ops.transfer.registry import model_identity
from gem_ops.transfer.student import Teacher, train_student, write_student_plan
from tests.training_data import learnable_data

GOLDEN = json.loads((Path(__file__).parent / "golden" / "student_distillation.json").read_text())
DRIFTING = replace(STRONG_SIGNAL, n_users=600, surfaces=(
    SurfaceSpec("feed", 0.45, 0.06, 0.4, ctr_drift=0.15), SurfaceSpec("reels", 0.25, 0.16, 0.35, ctr_drift=-0.10),
    SurfaceSpec("stories", 0.15, 0.06, None), SurfaceSpec("search", 0.15, 0.2, 0.4)))
WINDOWS = TransferWindows(student_days=2, staleness_days=2)
SHUFFLING = ShufflingConfig(sub_batch_size=32, sub_batches_per_rank=2)
# The model of the recording, before history tokens carried their items' features.
SMALL = model_config("vertical", width=0.5, history_item_features=False, **{"sequence.max_history_len": 16})
QUICK = TrainConfig(max_steps=12, eval_max_examples=1000, warmup_steps=3, lr_dense=3e-3)
# The same examples, weights and updates; the engine sums a step's loss per task before dividing by the
# labelled count, the old loop averaged first: float rounding only (measured: <= 5e-6 relative).
LOSS_RTOL = 1e-4


def test_student_with_distillation_matches_the_old_single_process_loop(tmp_path):
    logs = learnable_data(tmp_path / "data", DRIFTING, days=6, eval_days=1, max_history_len=32).open()
    plan = write_student_plan(logs, windows.teacher_examples(logs, WINDOWS), tmp_path / "plan.parquet", SHUFFLING, 16)
    model, teacher_run = train(logs, plan, SMALL, QUICK)
    scored = np.concatenate([windows.student_examples(logs, WINDOWS), windows.eval_examples(logs)])
    identity = model_identity("teacher", "1", "gem")
    teacher = Teacher(model, score_examples(model, logs, scored, identity), identity)
    # The golden figures come from trainable shared tables and the teacher's targets weighed as the labels (the
    # defaults when they were recorded).
    transfer = TransferConfig(adapter_steps=50, representation=False, distillation_head="auxiliary",
                              freeze_shared=False, distillation_weight=1.0)
    run = train_student(logs, windows.student_examples(logs, WINDOWS), windows.eval_examples(logs), SMALL, ("click",),
                        QUICK, tmp_path / "student", transfer, teacher, SHUFFLING)
    assert run.model.distillation_towers is not None and run.adapter_report
    assert teacher_run.losses == pytest.approx(GOLDEN["teacher_losses"], rel=LOSS_RTOL)
    assert run.result.losses == pytest.approx(GOLDEN["student_losses"], rel=LOSS_RTOL)
    for group, figures in GOLDEN["student_eval"].items():
        for metric, value in figures.items():
            assert run.result.final_report[group][metric] == pytest.approx(value, abs=1e-3), (group, metric)
