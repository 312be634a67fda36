"""Knowledge transfer mechanisms on small drifting synthetic logs: teacher predictions stored and joined,
the Student Adapter recalibrating a stale teacher, distillation and representation transfer in the
student, parameter sharing, and registry promotion with lineage on a real MLflow SQLite store."""

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from gem_ops.data.batch_shuffling import ShufflingConfig, read_plan
from gem_ops.data.synthetic import STRONG_SIGNAL, SurfaceSpec
from gem_ops.model.config import FeatureSpec, model_config
from gem_ops.model.features import model_input
from gem_ops.train.batches import newest_days
from gem_ops.train.config import TrainConfig
from gem_ops.train.engine import train
from gem_ops.train.model_state import seeded_model
from gem_ops.train.optimizer import build_optimizer, split_parameters
from gem_ops.transfer import windows
from gem_ops.transfer.adapter import adapt, fit_adapter
from gem_ops.transfer.config import TransferConfig, TransferWindows
from gem_ops.transfer.hierarchy import DomainData, students_examples, train_domain_foundation_model
from gem_ops.transfer.knowledge import (TeacherJoinedLogs, predictions_quality, read_predictions, score_examples,
                                       write_predictions)
from gem_ops.transfer.registry import (CHALLENGER, CHAMPION, TEACHER_NAME, TEACHER_VERSION, current_version,
                                       lineage_tags, model_identity, paired_ne_delta, promote_if_not_worse,
                                       register_student)
from gem_ops.transfer.sharing import fold_projections, embedding_tables, share_tables, sharing_config
from gem_ops.transfer.student import Teacher, prediction_report, student_config, train_student, write_student_plan
from gem_ops.transfer.user_representations import (NO_ITEM, compute_user_representations, read_user_representations,
                                                   write_user_representations)
from gem_ops.transfer.verticals import VerticalSettings, vertical_objectives
from tests.training_data import learnable_data

# Feed's click rate climbs and reels' falls day by day: a teacher trained on old days is miscalibrated now.
DRIFTING = replace(STRONG_SIGNAL, n_users=2000, surfaces=(
    SurfaceSpec("feed", 0.45, 0.06, 0.4, ctr_drift=0.15), SurfaceSpec("reels", 0.25, 0.16, 0.35, ctr_drift=-0.10),
    SurfaceSpec("stories", 0.15, 0.06, None), SurfaceSpec("search", 0.15, 0.2, 0.4)))
WINDOWS = TransferWindows(student_days=3, staleness_days=4)
SHUFFLING = ShufflingConfig(sub_batch_size=64, sub_batches_per_rank=2)
SMALL = model_config("vertical", **{"sequence.max_history_len": 32})
QUICK = TrainConfig(max_steps=40, eval_max_examples=2000, warmup_steps=5, lr_dense=3e-3)


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return learnable_data(tmp_path_factory.mktemp("transfer"), DRIFTING, days=10, eval_days=1,
                          max_history_len=64).open()


@pytest.fixture(scope="module")
def stale_teacher(logs, tmp_path_factory):
    """A small model trained only on the days before the students' window ends minus 4: stale."""
    root = tmp_path_factory.mktemp("teacher")
    old = windows.teacher_examples(logs, WINDOWS)
    plan = write_student_plan(logs, old, root / "plan.parquet", SHUFFLING, 32)
    model, _ = train(logs, plan, SMALL, replace(QUICK, max_steps=80))
    scored = np.concatenate([windows.student_examples(logs, WINDOWS), windows.eval_examples(logs)])
    identity = model_identity("teacher_test", "1", "gem")
    table = compute_user_representations(model, logs, scored, identity)
    return Teacher(model, score_examples(model, logs, scored, identity, representations=table), identity, table)


def test_user_representations_are_per_domain_user_and_day_and_need_no_candidate(logs, stale_teacher, tmp_path):
    """One row per (domain, user, day) the scored examples fall on, from the history before that day
    alone: examples of one user on one day and domain read the same vector, whatever their candidates."""
    table, predictions = stale_teacher.representations, stale_teacher.predictions
    idx = predictions.example_index
    keys = np.stack([logs.column("surface")[idx], logs.column("user_row")[idx],
                     logs.column("timestamp")[idx] // 86_400_000], 1)
    assert len(table) == len(np.unique(keys, axis=0)) and table.dim == SMALL.trunk_hidden
    first = {}
    for row, key in enumerate(map(tuple, keys)):
        if key in first:
            np.testing.assert_array_equal(predictions.representation[row], predictions.representation[first[key]])
        first.setdefault(key, row)
    assert len(first) < len(idx)  # some users have several requests a day: the test saw repeats
    # The vector is the teacher's output for a request with no candidate, at the day's first instant.
    user_row, day = keys[0, 1], keys[0, 2]
    request = logs.neutral_requests([user_row], [day * 86_400_000], [keys[0, 0]], NO_ITEM, 32)
    assert bool((request.history_age_seconds > 0).all())  # only events before the day
    stale_teacher.model.eval()
    with torch.no_grad():
        vector = stale_teacher.model.encode(model_input(request, stale_teacher.model.spec, stale_teacher.model.config))
    np.testing.assert_allclose(predictions.representation[0].astype(np.float32), vector[0].numpy(),
                               rtol=1e-2, atol=1e-3)
    back = read_user_representations(write_user_representations(table, tmp_path / "r.parquet"))
    np.testing.assert_array_equal(back.vectors, table.vectors)
    assert back.lookup(np.array([keys[0, 0]]), logs.user_ids[[user_row]], np.array([day * 86_400_000 + 5])).any()
    assert not back.lookup(np.array([keys[0, 0]]), np.array([-7]), np.array([day * 86_400_000])).any()  # unknown: 0


def test_the_summary_source_adds_the_sequence_arms_view_of_the_recent_events(logs, stale_teacher):
    """source "summary": the trunk's vector unchanged, then one mean of the last pyramid level per branch;
    it too is per (domain, user, day), from a neutral request (the same rows as the trunk's)."""
    model, idx = stale_teacher.model, stale_teacher.predictions.example_index[:300]
    trunk = compute_user_representations(model, logs, idx)
    summary = compute_user_representations(model, logs, idx, source="summary")
    branches = len(SMALL.sequence.branches)
    assert summary.dim == SMALL.trunk_hidden + branches * SMALL.embedding.sequence_dim
    assert np.array_equal(summary.user_id, trunk.user_id) and np.array_equal(summary.day, trunk.day)
    np.testing.assert_allclose(summary.vectors[:, :SMALL.trunk_hidden].astype(np.float32),
                               trunk.vectors.astype(np.float32), atol=2e-3)
    assert np.abs(summary.vectors[:, SMALL.trunk_hidden:].astype(np.float32)).sum(1).max() > 0
    with pytest.raises(ValueError, match="representation source 'candidate'"):
        compute_user_representations(model, logs, idx, source="candidate")


def test_windows_split_old_and_fresh_days(logs):
    old, fresh = windows.teacher_examples(logs, WINDOWS), windows.student_examples(logs, WINDOWS)
    ts = logs.column("timestamp")
    assert ts[old].max() < ts[fresh].min()  # 4 stale days > 3 student days: no overlap
    assert ts[fresh].max() < ts[windows.eval_examples(logs)].min()
    feed = windows.student_examples(logs, WINDOWS, "feed")
    assert set(logs.column("surface")[feed]) == {list(logs.surfaces).index("feed")}
    with pytest.raises(ValueError, match="unknown domain 'nowhere'"):
        windows.student_examples(logs, WINDOWS, "nowhere")


def test_a_domain_fm_learns_from_its_longer_window_and_its_adapter_from_the_fresh_days(logs, stale_teacher, tmp_path,
                                                                                      monkeypatch):
    ts, day = logs.column("timestamp"), 86_400_000
    train_days = np.unique(ts[logs.split_indices("train")] // day)
    every = DomainData.of(logs, "feed", TransferWindows(student_days=3))
    feed_train = windows._in_domain(logs, logs.split_indices("train"), "feed")
    assert np.array_equal(np.sort(every.foundation), np.sort(feed_train))  # None: every training day
    five = DomainData.of(logs, "feed", TransferWindows(student_days=3, domain_fm_days=5))
    assert set(five.train) < set(five.foundation) < set(every.foundation)
    assert np.array_equal(np.unique(ts[five.foundation] // day), train_days[-5:])
    with pytest.raises(ValueError, match=r"domain_fm_days \(2\) must be None \(every training day\) or at least "
                                         r"student_days \(3\)"):
        TransferWindows(student_days=3, domain_fm_days=2)
    window = TransferWindows(student_days=3, domain_fm_days=5)
    scored = students_examples(logs, window)  # GEM scores each FM and student example once, and the eval days
    assert len(np.unique(scored)) == len(scored)
    assert set(scored) == set(windows.domain_fm_examples(logs, window)) | set(windows.eval_examples(logs))

    identity = model_identity("teacher_test", "1", "gem")
    table = compute_user_representations(stale_teacher.model, logs, scored, identity)
    scores = score_examples(stale_teacher.model, logs, scored, identity, representations=table)
    gem = Teacher(stale_teacher.model, scores, identity, table)
    fitted_on = []

    def recording_fit(logs_, predictions, indices, *args):
        fitted_on.append(indices)
        return fit_adapter(logs_, predictions, indices, *args)

    monkeypatch.setattr("gem_ops.transfer.student.fit_adapter", recording_fit)
    fm_config = model_config("domain_fm", width=0.5, **{"sequence.max_history_len": 32})
    run = train_domain_foundation_model(logs, five, fm_config, replace(QUICK, max_steps=2), tmp_path, TransferConfig(),
                                        gem, SHUFFLING)
    planned = read_plan(tmp_path / "plan.parquet").ravel()
    assert set(planned) <= set(five.foundation) and np.setdiff1d(planned, five.train).size > 0  # older days too
    assert len(fitted_on) == 1 and np.array_equal(fitted_on[0], five.train)  # the adapter: today's labels only
    assert set(run.result.final_report) >= {"all/click", "feed/click"}


def test_an_objective_with_too_few_positives_gets_no_vertical_and_the_counts_say_why(logs):
    data = DomainData.of(logs, "feed", WINDOWS)
    counts = {task: min(logs.label_counts(data.train)[task][1], logs.label_counts(data.eval)[task][1])
              for task in logs.objectives}
    fewest = min(counts.values())

    def settings(min_positives):
        return VerticalSettings(SMALL, QUICK, TransferConfig(), SHUFFLING, min_positives=min_positives)

    tasks, left_out = vertical_objectives(logs, data, settings(fewest + 1))
    assert tasks == [t for t in logs.objectives if counts[t] > fewest] and tasks != list(logs.objectives)
    for task in set(logs.objectives) - set(tasks):
        why = left_out[f"feed/{task}"]
        assert f"{logs.label_counts(data.train)[task][1]} positives in {data.train.size} training examples" in why
        assert f"a vertical needs {fewest + 1} in each (min_positives)" in why
    assert vertical_objectives(logs, data, settings(fewest))[0] == list(logs.objectives)


def test_predictions_round_trip_and_join(logs, stale_teacher, tmp_path):
    predictions = stale_teacher.predictions
    path = write_predictions(predictions, tmp_path / "p.parquet")
    back = read_predictions(path)
    np.testing.assert_array_equal(back.example_index, predictions.example_index)
    np.testing.assert_array_equal(back.logits, predictions.logits)
    np.testing.assert_array_equal(back.representation, predictions.representation)
    assert back.teacher == {"name": "teacher_test", "version": "1", "kind": "gem"}
    joined = TeacherJoinedLogs(logs, back)
    some = predictions.example_index[[5, 0, 17]]
    batch = joined.batch(some, 32)
    row = {int(e): i for i, e in enumerate(predictions.example_index)}
    np.testing.assert_array_equal(batch.teacher_logits.numpy(), predictions.logits[[row[int(e)] for e in some]])
    assert batch.teacher_representation.shape == (3, SMALL.trunk_hidden)
    unscored = np.setdiff1d(np.arange(len(logs)), predictions.example_index)[:1]
    with pytest.raises(KeyError, match=f"did not score example.*{int(unscored[0])}"):
        joined.batch(unscored)
    with pytest.raises(FileNotFoundError, match="materialize teacher_predictions"):
        read_predictions(tmp_path / "missing.parquet")


def test_prediction_quality_reads_columns_by_objective(logs, stale_teacher):
    """Predictions of one objective (a vertical model's) are judged against that objective's labels."""
    from gem_ops.transfer.knowledge import predictions_quality

    both = stale_teacher.predictions
    conversion = replace(both, logits=both.logits[:, [both.objectives.index("conversion")]], objectives=("conversion",))
    eval_rows = windows.eval_examples(logs)
    single = predictions_quality(logs, conversion, eval_rows, ("conversion",))
    assert single["all/conversion"] == predictions_quality(logs, both, eval_rows, ("conversion",))["all/conversion"]
    with pytest.raises(ValueError, match=r"tasks \['click'\] are not objectives of both"):
        predictions_quality(logs, conversion, eval_rows, ("click",))
    with pytest.raises(ValueError, match="do not cover"):
        predictions_quality(logs, conversion, windows.teacher_examples(logs, WINDOWS)[:5], ("conversion",))


def test_student_adapter_recalibrates_a_stale_teacher(logs, stale_teacher):
    fresh, held_out = windows.student_examples(logs, WINDOWS), windows.eval_examples(logs)
    adapter = fit_adapter(logs, stale_teacher.predictions, fresh, steps=300)
    adapted = adapt(adapter, logs, stale_teacher.predictions)
    config = replace(SMALL, tasks=("click",))
    miss = lambda report, domain: abs(report[f"{domain}/click"]["calibration"] - 1)  # noqa: E731
    stale_on_fresh = prediction_report(logs, stale_teacher.predictions, fresh, config)
    adapted_on_fresh = prediction_report(logs, adapted, fresh, config)
    before = prediction_report(logs, stale_teacher.predictions, held_out, config)
    after = prediction_report(logs, adapted, held_out, config)
    stale = [d for d in logs.surfaces if miss(stale_on_fresh, d) > 0.15]
    assert "feed" in stale, stale_on_fresh  # feed's click rate grew 15% a day since the teacher's data
    for domain in logs.surfaces:
        assert miss(adapted_on_fresh, domain) < 0.05, (domain, adapted_on_fresh[f"{domain}/click"])
    for domain in stale:  # on the later eval day, the staleness fresh labels revealed is gone
        assert miss(after, domain) < miss(before, domain) / 2, (domain, before[f"{domain}/click"],
                                                                after[f"{domain}/click"])
    assert after["all/click"]["ne"] < before["all/click"]["ne"]


def test_student_adapter_with_a_candidate_feature_takes_out_a_shift_per_category(logs, stale_teacher):
    """A teacher whose logits are off by a shift per item category (a category's season its days did not
    show): the adapter with adapter_feature "item_category" learns the shifts from the fresh labels and scores
    the later eval day better than the adapter without it, which can only move whole surfaces."""
    fresh, held_out = windows.student_examples(logs, WINDOWS), windows.eval_examples(logs)
    category = logs.column("item_category")[stale_teacher.predictions.example_index]
    shift = np.random.default_rng(0).normal(0.0, 1.5, category.max() + 1)[category]
    shifted = stale_teacher.predictions.with_logits(stale_teacher.predictions.logits + shift[:, None])
    config = replace(SMALL, tasks=("click",))
    ne = {}
    for feature in ("", "item_category"):
        adapter = fit_adapter(logs, shifted, fresh, steps=300, feature=feature, feature_buckets=64)
        assert (adapter.feature_shift is not None) == bool(feature)
        ne[feature] = prediction_report(logs, adapt(adapter, logs, shifted), held_out, config)["all/click"]["ne"]
    teacher = prediction_report(logs, stale_teacher.predictions, held_out, config)["all/click"]["ne"]
    assert ne["item_category"] < ne[""] - 0.02 and ne["item_category"] < teacher + 0.01, (ne, teacher)
    with pytest.raises(ValueError, match="adapter_feature 'item_genre' is not a sparse feature"):
        fit_adapter(logs, shifted, fresh, steps=1, feature="item_genre", feature_buckets=8)


def test_a_shift_only_adapter_keeps_the_teachers_ranking_within_a_domain_and_category(logs, stale_teacher):
    fresh, teacher = windows.student_examples(logs, WINDOWS), stale_teacher.predictions
    adapter = fit_adapter(logs, teacher, fresh, steps=300, feature="item_category", feature_buckets=64, shift_only=True)
    assert adapter.mlp is None and torch.equal(adapter.scale, torch.ones_like(adapter.scale))
    moved = adapt(adapter, logs, teacher).logits - teacher.logits
    rows = teacher.example_index
    group = logs.column("surface")[rows] * 64 + logs.column("item_category")[rows] % 64
    for g in np.unique(group):  # one shift per (domain, category): the order inside it is the teacher's
        assert np.ptp(moved[group == g], axis=0).max() < 1e-5
    assert np.abs(moved).max() > 0.05  # it did move the groups
    full = adapt(fit_adapter(logs, teacher, fresh, steps=300), logs, teacher).logits - teacher.logits
    assert max(np.ptp(full[group == g], axis=0).max() for g in np.unique(group)) > 1e-3


def test_a_shrunk_adapter_fitted_on_few_labels_stays_nearer_the_teacher(logs, stale_teacher):
    """adapter_shrinkage: the prior weighs against each task's labels, so an adapter fitted on a few dozen
    examples moves the teacher's logits much less than one without it, and one fitted on the fresh days still
    recalibrates every surface."""
    fresh = windows.student_examples(logs, WINDOWS)
    teacher = stale_teacher.predictions

    def moved(rows, shrink):
        adapted = adapt(fit_adapter(logs, teacher, rows, steps=300, shrink=shrink), logs, teacher)
        return float(np.abs(adapted.logits - teacher.logits).mean()), adapted

    assert moved(fresh[:40], True)[0] < moved(fresh[:40], False)[0] / 4
    config = replace(SMALL, tasks=("click",))
    report = prediction_report(logs, moved(fresh, True)[1], fresh, config)
    for domain in logs.surfaces:
        assert abs(report[f"{domain}/click"]["calibration"] - 1) < 0.05, (domain, report[f"{domain}/click"])


def test_distillation_head_and_teacher_token(logs, stale_teacher):
    config = student_config(SMALL, ("click",), TransferConfig(shared_tables=(), distillation_head="auxiliary"),
                            stale_teacher)
    assert config.distillation_weight == 4.0 and config.teacher_representation_dim == SMALL.trunk_hidden
    spec = FeatureSpec.from_logs(logs)
    model = seeded_model(spec, config)
    joined = TeacherJoinedLogs(logs, stale_teacher.predictions, stale_teacher.representations)
    x = model_input(joined.batch(stale_teacher.predictions.example_index[:64], 32), spec, config)
    assert x.labels.shape == (64, 1) and x.teacher_logits.shape == (64, 1)
    whole = joined.batch(stale_teacher.predictions.example_index[:64], 32)
    cut = joined.batch(stale_teacher.predictions.example_index[:64], 32,
                       history_caps=np.full(64, 2))  # history_cut_share
    assert int(cut.history_lengths.max()) <= 2 < int(whole.history_lengths.max())
    assert torch.equal(cut.teacher_logits, whole.teacher_logits)
    total, per_task, _ = model.loss(x)
    assert float(total.detach()) > float(per_task.sum())  # the distillation term is added
    total.backward()
    assert model.distillation_towers.weights[0].grad.abs().sum() > 0
    assert model.teacher_proj[1].weight.grad.abs().sum() > 0
    # The representation is an input whose projection starts at zero: the student begins as it would without
    # it, and once the projection has learnt weights, changing the representation changes the prediction.
    model.eval()
    with torch.no_grad():
        other = replace(x, teacher_representation=torch.randn_like(x.teacher_representation))
        assert torch.allclose(model(x), model(other))
        model.teacher_proj[1].weight.normal_()
        assert not torch.allclose(model(x), model(other))
    with pytest.raises(ValueError, match="teacher representation of width"):
        model_input(logs.batch([0]), spec, config)


def test_serving_head_distillation_learns_soft_targets_without_a_head_of_its_own(logs, stale_teacher):
    """distillation_head='serving': no auxiliary towers; the serving head's loss is its log loss on the labels
    plus distillation_weight x its log loss on the teacher's probabilities."""
    from gem_ops.model.heads import masked_bce_sums

    transfer = TransferConfig(shared_tables=(), representation=False, distillation_head="serving",
                              distillation_weight=0.5)
    config = student_config(SMALL, ("click",), transfer, stale_teacher)
    assert config.distillation_head == "serving"
    spec = FeatureSpec.from_logs(logs)
    model = seeded_model(spec, config)
    assert model.distillation_towers is None
    joined = TeacherJoinedLogs(logs, stale_teacher.predictions, stale_teacher.representations)
    x = model_input(joined.batch(stale_teacher.predictions.example_index[:64], 32), spec, config)
    sums = model.loss_sums(x)
    on_labels, _ = masked_bce_sums(sums.logits, x.labels, x.label_mask)
    on_teacher, _ = masked_bce_sums(sums.logits, torch.sigmoid(x.teacher_logits.float()), x.label_mask)
    torch.testing.assert_close(sums.total, on_labels + 0.5 * on_teacher)


def test_parameter_sharing_copies_and_freezes_the_named_tables(logs):
    spec = FeatureSpec.from_logs(logs)
    teacher = seeded_model(spec, model_config("gem"), seed=1)  # wider than the vertical preset everywhere
    base = model_config("vertical")
    with pytest.raises(ValueError, match="cannot share embedding table 'item'.*sharing_config"):
        share_tables(seeded_model(spec, base), teacher, ("item",))
    config = sharing_config(base, teacher.config, ("item", "user_id"))
    assert (config.embedding.sequence_dim, config.embedding.dim) == (base.embedding.sequence_dim, base.embedding.dim)
    assert dict(config.embedding.table_widths) == {"item": teacher.config.embedding.sequence_dim,
                                                   "user_id": teacher.config.embedding.dim}
    assert config.embedding.item_buckets == teacher.config.embedding.item_buckets
    assert config.embedding.sparse_buckets == base.embedding.sparse_buckets  # not shared: stays small
    student = seeded_model(spec, config, seed=2)
    share_tables(student, teacher, ("item", "user_id"), freeze=True)
    ours, theirs = embedding_tables(student), embedding_tables(teacher)
    for name in ("item", "user_id"):
        assert torch.equal(ours[name], theirs[name]) and not ours[name].requires_grad
    tables, _ = split_parameters(student)
    assert not any(name.endswith((".item.weight", ".user_id.weight")) for name in tables)
    before = {k: v.detach().clone() for k, v in ours.items()}
    optimizer = build_optimizer(student, QUICK)
    x = model_input(logs.batch(np.arange(64), 32), spec, config)
    student.loss(x)[0].backward()
    optimizer.step()
    assert torch.equal(ours["item"], before["item"]) and torch.equal(ours["user_id"], before["user_id"])
    assert not torch.equal(ours["history_age"], before["history_age"])  # unshared tables learn


def test_a_shared_table_reaches_a_narrower_student_through_its_projection(logs):
    """The student keeps its width and its size apart from the table: its candidate embedding is the
    teacher's table row through a projection that starts at the table's principal directions and learns."""
    from gem_ops.model.features import CANDIDATE_ITEM

    spec = FeatureSpec.from_logs(logs)
    teacher = seeded_model(spec, model_config("gem"), seed=1)  # sequence width 64 against the vertical's 32
    base = model_config("vertical")
    student = seeded_model(spec, sharing_config(base, teacher.config, ("item",)), seed=2)
    share_tables(student, teacher, ("item",), freeze=True)
    projection = student.embeddings.projections["item"]
    assert (projection.in_features, projection.out_features) == (teacher.config.embedding.sequence_dim,
                                                                base.embedding.sequence_dim)
    assert student.branches[0].layers[0].qkv.in_features == base.embedding.sequence_dim  # the arm stays narrow
    table = embedding_tables(teacher)["item"].detach()
    rows = projection.weight.detach()
    np.testing.assert_allclose((rows @ rows.T).numpy(), np.eye(rows.shape[0]), atol=1e-5)  # orthonormal
    x = model_input(logs.batch(np.arange(16), 32), spec, student.config)
    seq = student.embeddings._sequence_lookups(x.sequence)
    ids = x.sequence[CANDIDATE_ITEM].values()
    torch.testing.assert_close(student.embeddings._at_width(CANDIDATE_ITEM, seq[CANDIDATE_ITEM]),
                               projection(table[ids]))
    optimizer = build_optimizer(student, QUICK)
    before = projection.weight.detach().clone()
    student.loss(x)[0].backward()
    optimizer.step()
    assert not torch.equal(projection.weight, before) and torch.equal(embedding_tables(student)["item"], table)
    alone = seeded_model(spec, base)
    size = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert (size(student) - size(alone)
            == table.numel() - embedding_tables(alone)["item"].numel() + projection.weight.numel())

    # Trained, it is folded to serve at the student's own width (the teacher's rows, as ids hash to them),
    # computing the same outputs: beside the alone model it only has the extra rows.
    folded = fold_projections(student.eval())
    ours, alone_item = embedding_tables(folded)["item"], embedding_tables(alone)["item"]
    assert len(folded.embeddings.projections) == 0 and ours.shape == (table.shape[0], alone_item.shape[1])
    assert size(folded) - size(alone) == ours.numel() - alone_item.numel()
    with torch.no_grad():
        torch.testing.assert_close(folded.eval()(x), student(x), atol=1e-5, rtol=1e-4)


def killed_at(step: int) -> list:
    """Training step hooks that stop the job at `step` as a kill would (no chance to clean up)."""
    def on_step(at, loss):
        if at == step:
            raise KeyboardInterrupt("killed")
    return [on_step]


def test_direct_student_trains_with_every_mechanism(logs, stale_teacher, tmp_path, monkeypatch):
    feed = list(logs.surfaces).index("feed")
    fresh = windows.student_examples(logs, WINDOWS, "feed")
    held_out = windows.eval_examples(logs, "feed")
    adapters = []

    def recording_fit(*args):
        adapters.append(fit_adapter(*args))
        return adapters[-1]

    monkeypatch.setattr("gem_ops.transfer.student.fit_adapter", recording_fit)
    run = train_student(logs, fresh, held_out, SMALL, ("click",), replace(QUICK, max_steps=10), tmp_path,
                        TransferConfig(freeze_shared=True, adapter_feature="item_category"), stale_teacher, SHUFFLING)
    assert len(adapters) == 1 and adapters[0].feature_shift.abs().sum() > 0  # the category shifts were fitted
    assert torch.equal(embedding_tables(run.model)["item"], embedding_tables(stale_teacher.model)["item"])
    # The teacher's targets on the serving head by default: no auxiliary towers.
    assert run.model.teacher_proj is not None and run.model.distillation_towers is None
    assert run.model.config.distillation_head == "serving" and run.model.config.distillation_weight == 4.0
    assert set(run.adapter_report) == {"teacher", "adapted"}
    assert set(run.result.final_report) == {"all/click", "feed/click"}
    assert (logs.column("surface")[held_out] == feed).all()


def test_a_held_out_adapter_fits_only_the_validation_day_the_student_does_not_train_on(logs, stale_teacher, tmp_path,
                                                                                      monkeypatch):
    fresh = windows.student_examples(logs, WINDOWS, "feed")
    fitted_on = []

    def recording_fit(logs_, predictions, indices, *args):
        fitted_on.append(np.asarray(indices))
        return fit_adapter(logs_, predictions, indices, *args)

    monkeypatch.setattr("gem_ops.transfer.student.fit_adapter", recording_fit)
    settings = replace(QUICK, max_steps=4, validation_days=1, eval_every=2)
    for fit in ("fresh", "held_out"):
        train_student(logs, fresh, windows.eval_examples(logs, "feed"), SMALL, ("click",), settings, tmp_path / fit,
                      TransferConfig(freeze_shared=True, adapter_fit=fit), stale_teacher, SHUFFLING)
    day = logs.column("timestamp") // 86_400_000
    newest = fresh[day[fresh] == day[fresh].max()]
    assert np.array_equal(np.sort(fitted_on[0]), np.sort(fresh))  # "fresh": every fresh day, the held-out one too
    assert np.array_equal(np.sort(fitted_on[1]), np.sort(newest))  # "held_out": only the day the engine holds out
    plan = tmp_path / "held_out" / "plan.parquet"
    trained_on = np.setdiff1d(read_plan(plan).ravel(), newest_days(logs, plan, 1))  # the engine's training steps
    assert trained_on.size and np.intersect1d(fitted_on[1], trained_on).size == 0
    assert np.isin(newest_days(logs, plan, 1), fitted_on[1]).all()  # and every example it validates on
    with pytest.raises(ValueError, match="adapter_fit must be 'fresh' or 'held_out'"):
        TransferConfig(adapter_fit="newest")
    with pytest.raises(ValueError, match="validation_days"):
        train_student(logs, fresh, windows.eval_examples(logs, "feed"), SMALL, ("click",), QUICK, tmp_path / "none",
                      TransferConfig(freeze_shared=True, adapter_fit="held_out"), stale_teacher, SHUFFLING)


def test_killed_student_resumes_from_its_checkpoint(logs, stale_teacher, tmp_path, monkeypatch):
    """A student killed mid-training resumes where its last checkpoint was and ends where an unbroken run
    would; a different training in the same folder starts afresh; a finished one leaves no checkpoints."""
    import gem_ops.transfer.student as student

    fresh, held_out = windows.student_examples(logs, WINDOWS, "feed"), windows.eval_examples(logs, "feed")
    config = replace(QUICK, max_steps=12, checkpoint_every=5)

    def run(train_config=config):
        return train_student(logs, fresh, held_out, SMALL, ("click",), train_config, tmp_path, TransferConfig(),
                             stale_teacher, SHUFFLING)

    unbroken = run()
    assert not (tmp_path / "checkpoints").exists()

    real_train = student.train

    def killed_at_step_7(*args, **kwargs):
        return real_train(*args, step_hooks=killed_at(7), **kwargs)

    monkeypatch.setattr(student, "train", killed_at_step_7)
    with pytest.raises(KeyboardInterrupt):
        run()
    monkeypatch.setattr(student, "train", real_train)
    assert (tmp_path / "checkpoints" / "step_00000005").is_dir()
    resumed = run()
    assert resumed.result.resumed_from == 5 and resumed.result.steps == 12
    np.testing.assert_allclose(resumed.result.losses, unbroken.result.losses, rtol=1e-4)

    monkeypatch.setattr(student, "train", killed_at_step_7)
    with pytest.raises(KeyboardInterrupt):
        run()
    monkeypatch.setattr(student, "train", real_train)
    changed = run(replace(config, lr_dense=config.lr_dense / 2))  # another training: the checkpoint is not its
    assert changed.result.resumed_from is None and changed.result.steps == 12


def test_promotion_keeps_out_a_worse_challenger_and_records_lineage(logs, stale_teacher, tmp_path):
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("transfer", artifact_location=str(tmp_path / "artifacts"))
    fresh, held_out = windows.student_examples(logs, WINDOWS, "feed"), windows.eval_examples(logs, "feed")
    name, tags = "vertical_feed_click", lineage_tags("direct", stale_teacher.identity)
    versions = []
    for steps in (60, 1):  # a trained challenger, then one that has barely trained
        run = train_student(logs, fresh, held_out, SMALL, ("click",), replace(QUICK, max_steps=steps),
                            tmp_path / str(steps), TransferConfig(representation=False), stale_teacher, SHUFFLING)
        mlflow_run = client.create_run(experiment)
        versions.append(register_student(client, mlflow_run.info.run_id, run.model, run.data, held_out, name, tags,
                                         CHALLENGER))
    good, bad = versions
    first = promote_if_not_worse(client, name, logs, held_out, "click", good)
    assert first.promoted and "no champion yet; against the base rate's NE 1" in first.reason
    assert first.ne_delta == pytest.approx(first.challenger["ne"] - 1.0, abs=1e-6) and first.ne_delta < 0
    second = promote_if_not_worse(client, name, logs, held_out, "click", bad)
    assert not second.promoted and second.champion_version == good
    assert second.challenger["ne"] > second.champion["ne"]
    assert second.ne_delta == pytest.approx(second.challenger["ne"] - second.champion["ne"], rel=1e-6)
    # Far worse than the sample's noise: kept out with the default allowance of 1.645 standard errors too.
    assert second.ne_delta > 1.645 * second.ne_delta_stderr
    assert not promote_if_not_worse(client, name, logs, held_out, "click", bad, ne_standard_errors=1.645).promoted
    assert current_version(client, name, CHAMPION) == good and current_version(client, name, CHALLENGER) == bad
    recorded = client.get_model_version(name, bad).tags
    assert recorded["promotion.decision"] == "kept_out"
    assert float(recorded["promotion.ne_delta"]) == pytest.approx(second.ne_delta, abs=1e-6)  # tags keep 6 decimals
    assert float(recorded["promotion.ne_delta_stderr"]) == pytest.approx(second.ne_delta_stderr, abs=1e-6)
    assert float(recorded["promotion.champion_ne"]) == pytest.approx(second.champion["ne"], rel=1e-5)
    assert recorded[TEACHER_NAME] == "teacher_test" and recorded[TEACHER_VERSION] == "1"
    assert recorded["transfer.mode"] == "direct"


def test_a_first_challenger_worse_than_the_base_rate_is_kept_out_and_a_promoted_one_loses_challenger(
        logs, stale_teacher, tmp_path):
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("transfer", artifact_location=str(tmp_path / "artifacts"))
    fresh, held_out = windows.student_examples(logs, WINDOWS, "feed"), windows.eval_examples(logs, "feed")
    name, tags = "vertical_feed_click", lineage_tags("alone", {})
    run = train_student(logs, fresh, held_out, SMALL, ("click",), replace(QUICK, max_steps=30), tmp_path / "good",
                        TransferConfig(), None, SHUFFLING)
    good = register_student(client, client.create_run(experiment).info.run_id, run.model, run.data, held_out, name,
                            tags, CHALLENGER)
    with torch.no_grad():  # the same model, its every prediction pushed far above the click rate
        scale, shift = run.model.output_calibration.calibration
        run.model.output_calibration.set_calibration(scale, shift + 4.0)
    worse = register_student(client, client.create_run(experiment).info.run_id, run.model, run.data, held_out, name,
                             tags, CHALLENGER)
    kept_out = promote_if_not_worse(client, name, logs, held_out, "click", worse, ne_standard_errors=1.645)
    assert (not kept_out.promoted and kept_out.challenger["ne"] > 1
            and kept_out.ne_delta > 1.645 * kept_out.ne_delta_stderr)
    assert "no champion yet; against the base rate's NE 1" in kept_out.reason
    assert current_version(client, name, CHAMPION) is None and current_version(client, name, CHALLENGER) == worse
    assert client.get_model_version(name, worse).tags["promotion.decision"] == "kept_out"

    client.set_registered_model_alias(name, CHALLENGER, good)
    promoted = promote_if_not_worse(client, name, logs, held_out, "click", good, ne_standard_errors=1.645)
    assert promoted.promoted and promoted.challenger["ne"] < 1
    assert current_version(client, name, CHAMPION) == good and current_version(client, name, CHALLENGER) is None


def test_paired_ne_delta_is_the_ne_difference_with_its_paired_standard_error(logs, stale_teacher):
    """Scored on the same examples, the difference of two models' NE is the mean of per-example differences, and
    their spread gives its standard error: a change at the noise level stays within a few standard errors, a
    real degradation lies far outside, and identical predictions differ by exactly nothing."""
    champion, held_out = stale_teacher.predictions, windows.eval_examples(logs)
    noise = np.random.default_rng(0).normal(size=champion.logits.shape).astype(np.float32)
    jittered = champion.with_logits(champion.logits + 0.01 * noise)
    uninformed = champion.with_logits(np.zeros_like(champion.logits))  # p = 0.5 everywhere

    def ne(predictions):
        return predictions_quality(logs, predictions, held_out, ("click",))["all/click"]["ne"]

    for challenger in (jittered, uninformed):
        delta, stderr = paired_ne_delta(logs, challenger, champion, held_out, "click")
        assert delta == pytest.approx(ne(challenger) - ne(champion), rel=1e-6, abs=1e-9) and stderr > 0
    delta, stderr = paired_ne_delta(logs, jittered, champion, held_out, "click")
    assert abs(delta) < 3 * stderr
    delta, stderr = paired_ne_delta(logs, uninformed, champion, held_out, "click")
    assert delta > 10 * stderr
    assert paired_ne_delta(logs, champion, champion, held_out, "click") == (0.0, 0.0)


@pytest.mark.parametrize(("scores", "kept"), [((0.90, 0.80), "trained"), ((0.80, 0.90), "fixed"),
                                              ((0.85, 0.85), "fixed")])
def test_auto_shared_tables_train_both_students_and_keep_the_lower_validation_ne(logs, stale_teacher, tmp_path,
                                                                                  monkeypatch, scores, kept):
    """freeze_shared="auto": one student with the teacher's tables fixed, one with them trained, each in an MLflow
    run of its own under the student's; the lower validation NE is kept (a tie keeps the teacher's tables)."""
    import gem_ops.transfer.student as student
    from gem_ops.tracking import RunTracker

    validation = iter(scores)
    monkeypatch.setattr(student, "kept_validation_ne", lambda result, objectives: next(validation))
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.create_experiment("students", artifact_location=(tmp_path / "artifacts").as_uri())
    parent = client.create_run(experiment).info.run_id
    fresh, held_out = windows.student_examples(logs, WINDOWS, "feed"), windows.eval_examples(logs, "feed")
    run = train_student(logs, fresh, held_out, SMALL, ("click",), replace(QUICK, max_steps=8, validation_days=1),
                        tmp_path / "work", TransferConfig(), stale_teacher, SHUFFLING, RunTracker(client, parent))
    assert run.shared_tables == {"kept": kept, "validation_ne": dict(zip(("fixed", "trained"), scores))}
    same_table = torch.equal(embedding_tables(run.model)["item"], embedding_tables(stale_teacher.model)["item"])
    assert same_table == (kept == "fixed")
    children = client.search_runs([client.get_run(parent).info.experiment_id],
                                  f"tags.`mlflow.parentRunId` = '{parent}'")
    assert sorted(c.info.run_name for c in children) == ["fixed shared tables", "trained shared tables"]
    recorded = client.get_run(parent).data
    assert recorded.params["shared_tables"] == kept
    assert recorded.metrics["shared_tables.validation_ne.trained"] == pytest.approx(scores[1])


def test_a_student_killed_in_its_second_candidate_does_not_train_the_first_again(logs, stale_teacher, tmp_path,
                                                                                  monkeypatch):
    """freeze_shared="auto" trains two candidates in turn: a job killed while the second trains resumes it from
    its checkpoint with the first candidate's finished record, keeps what an unbroken run keeps, and leaves no
    checkpoints once the student is whole."""
    import gem_ops.transfer.student as student

    fresh, held_out = windows.student_examples(logs, WINDOWS, "feed"), windows.eval_examples(logs, "feed")
    config = replace(QUICK, max_steps=8, validation_days=1, checkpoint_every=3)

    def run(folder):
        return train_student(logs, fresh, held_out, SMALL, ("click",), config, folder, TransferConfig(),
                             stale_teacher, SHUFFLING)

    unbroken = run(tmp_path / "unbroken")
    real_train, trained = student.train, []

    def second_killed_at_step_5(*args, **kwargs):
        trained.append(Path(kwargs["checkpoint_dir"]).parent.name)
        return real_train(*args, **kwargs, **({"step_hooks": killed_at(5)} if len(trained) == 2 else {}))

    monkeypatch.setattr(student, "train", second_killed_at_step_5)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "killed")
    assert trained == ["fixed_tables", "trained_tables"]
    assert (tmp_path / "killed" / "fixed_tables" / "checkpoints" / student.FINISHED_RESULT).exists()

    trained.clear()
    monkeypatch.setattr(student, "train", lambda *args, **kwargs: trained.append(
        Path(kwargs["checkpoint_dir"]).parent.name) or real_train(*args, **kwargs))
    resumed = run(tmp_path / "killed")
    assert trained == ["trained_tables"], "the finished first candidate was trained again"
    assert resumed.result.steps == 8
    assert resumed.shared_tables["kept"] == unbroken.shared_tables["kept"]
    assert resumed.shared_tables["validation_ne"]["fixed"] == unbroken.shared_tables["validation_ne"]["fixed"]
    assert resumed.shared_tables["validation_ne"]["trained"] == pytest.approx(
        unbroken.shared_tables["validation_ne"]["trained"], rel=1e-3)
    for name, weights in resumed.model.state_dict().items():
        torch.testing.assert_close(weights, unbroken.model.state_dict()[name], rtol=1e-3, atol=1e-4, msg=name)
    assert not list((tmp_path / "killed").rglob("checkpoints"))


def test_auto_shared_tables_without_validation_days_keep_the_teachers_tables():
    from gem_ops.transfer.student import shared_table_choices

    assert shared_table_choices(TransferConfig(), True, validated=False) == (True,)
    assert shared_table_choices(TransferConfig(), True, validated=True) == (True, False)
    assert shared_table_choices(TransferConfig(freeze_shared=False), True, validated=True) == (False,)
    assert shared_table_choices(TransferConfig(), False, validated=True) == (None,)
    assert shared_table_choices(TransferConfig(shared_tables=()), True, validated=True) == (None,)
    with pytest.raises(ValueError, match="freeze_shared"):
        TransferConfig(freeze_shared="sometimes")


def test_kept_validation_ne_is_the_best_evaluations_pooled_ne():
    """What "auto" compares: the lowest validation NE of the run (the weights it kept), pooled over objectives."""
    from gem_ops.train.engine import TrainResult
    from gem_ops.transfer.student import kept_validation_ne

    def report(ne_click, ne_conversion):  # the same counts and base-rate entropy per objective
        return {"all/click": {"log_loss": 0.5 * ne_click, "ne": ne_click, "count": 100},
                "all/conversion": {"log_loss": 0.5 * ne_conversion, "ne": ne_conversion, "count": 100}}

    result = TrainResult(steps=30, samples=0, seconds=0.0, losses=[],
                         validation_reports=[report(0.9, 1.0), report(0.8, 0.9), report(0.85, 0.95)])
    assert kept_validation_ne(result, ("click", "conversion")) == pytest.approx(0.85)
    assert kept_validation_ne(result, ("click",)) == pytest.approx(0.8)
    assert kept_validation_ne(TrainResult(steps=0, samples=0, seconds=0.0, losses=[]), ("click",)) == float("inf")


def test_the_student_and_the_benchmark_keep_the_same_shared_tables_candidate():
    """The lower validation NE is kept, a tie keeps the teacher's tables fixed: in the student and in the transfer
    benchmark's summary of a fixed/trained pair of variants alike."""
    from benchmarks.transfer import with_validated_pair
    from gem_ops.transfer.student import kept_tables

    for fixed, trained, kept in ((0.9, 0.8, "trained"), (0.8, 0.9, "fixed"), (0.8, 0.8, "fixed")):
        assert kept_tables({"trained": trained, "fixed": fixed}) == kept
        row = {"a": {"validation_ne": fixed, "auc": 1.0}, "b": {"validation_ne": trained, "auc": 2.0}}
        validated = with_validated_pair(row, ("a", "b"))["validated_tables"]
        assert validated["kept_fixed_tables"] == float(kept == "fixed")
        assert validated["auc"] == (1.0 if kept == "fixed" else 2.0)


def test_a_domain_fms_summary_leaves_out_the_auc_of_a_one_class_group():
    from gem_ops.transfer.domain_models import DomainModel

    report = {"all/click": {"auc": 0.71234, "ne": 0.9}, "all/conversion": {"auc": float("nan"), "ne": 1.0},
              "feed/click": {"auc": 0.7}}
    summary = DomainModel("domain_fm_stories", "3", 100, report).summary()
    assert summary == {"model": "domain_fm_stories", "version": "3", "train_examples": 100, "all/click": 0.7123}
