"""The training loop: resume after an interruption gives the uninterrupted run, checkpoints are pruned
and survive, evaluation runs periodically, warm start loads weights, bad losses stop the run."""

import dataclasses
import json
import logging
import math
from pathlib import Path

import pytest
import torch

from gem_ops.model.config import FeatureSpec, ModelConfig, model_config
from gem_ops.train.checkpoint import checkpoint_steps, load_checkpoint
from gem_ops.train.config import TrainConfig
from gem_ops.train import warm_start
from gem_ops.train.engine import train
from gem_ops.data.synthetic import STRONG_SIGNAL
from tests.training_data import learnable_data

TINY = model_config("vertical", width=0.5, **{"sequence.max_history_len": 16})
CONFIG = TrainConfig(max_steps=6, eval_max_examples=128, log_every=2, warmup_steps=2)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    small = dataclasses.replace(STRONG_SIGNAL, n_users=400)
    return learnable_data(tmp_path_factory.mktemp("training"), small, days=4, eval_days=1, max_history_len=32,
                          sub_batch_size=16)


def test_resumed_run_matches_the_uninterrupted_run(data, tmp_path):
    logs = data.open()
    whole_model, whole = train(logs, data.plans[1], TINY, CONFIG, checkpoint_dir=tmp_path / "whole")
    interrupted = dataclasses.replace(CONFIG, max_steps=3)
    train(logs, data.plans[1], TINY, interrupted, checkpoint_dir=tmp_path / "resumed")  # "killed" after step 3
    resumed_model, resumed = train(logs, data.plans[1], TINY, CONFIG, checkpoint_dir=tmp_path / "resumed")
    assert resumed.resumed_from == 3 and resumed.steps == whole.steps == 6
    # Same data, weights and optimizer state; only float summation order may differ (threaded kernels).
    assert resumed.losses == pytest.approx(whole.losses, rel=1e-4)
    for (name, a), (_, b) in zip(whole_model.state_dict().items(), resumed_model.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4, msg=lambda m: f"{name}: {m}")


def test_a_job_resumed_after_its_last_step_states_no_throughput_and_keeps_its_steps(data, tmp_path, caplog):
    """A restart that finds the last step's checkpoint (a job killed after saving it) trains nothing: its samples/s
    is NaN (none measured), not a rate of zero reported as the job's throughput."""
    caplog.set_level(logging.INFO)
    config = dataclasses.replace(CONFIG, max_steps=2)
    _, first = train(data.open(), data.plans[1], TINY, config, checkpoint_dir=tmp_path)
    _, again = train(data.open(), data.plans[1], TINY, config, checkpoint_dir=tmp_path)
    assert first.samples > 0 and first.samples_per_second > 0
    assert again.resumed_from == 2 and again.steps == 2 and again.samples == 0
    assert math.isnan(again.samples_per_second) and math.isnan(again.metadata()["samples_per_second"])
    assert again.losses == first.losses
    assert "nothing trained this session: resumed at step 2" in caplog.text


def test_resuming_into_another_model_names_the_settings_that_differ(data, tmp_path):
    train(data.open(), data.plans[1], TINY, dataclasses.replace(CONFIG, max_steps=1), checkpoint_dir=tmp_path)
    # No weight changes shape (a warm start would take it), but the training resumed would not be this one.
    other = dataclasses.replace(TINY, sequence=dataclasses.replace(TINY.sequence, qkv_bias=False))
    with pytest.raises(ValueError, match=r"cannot resume from .*model\.sequence\.qkv_bias: True there, False here"):
        train(data.open(), data.plans[1], other, CONFIG, checkpoint_dir=tmp_path)


def test_settings_read_back_from_json_equal_the_saved_ones_and_resume(tmp_path, monkeypatch):
    # A student whose tables are shared through projections: its nested tuples are saved as lists of lists.
    config = dataclasses.replace(TINY, embedding=dataclasses.replace(TINY.embedding, table_widths=(("item", 16),)))
    spec = FeatureSpec(surfaces=("feed",), event_types=("click",), objectives=("click",), sparse_features=("item",),
                       dense_features=(), history_item_features=("item",))
    saved = json.loads(json.dumps({"model_config": config.to_dict(), "spec": dataclasses.asdict(spec)}))
    monkeypatch.setattr(warm_start, "checkpoint_folder", Path)
    monkeypatch.setattr(warm_start, "read_progress", lambda path: saved)
    assert ModelConfig.from_dict(saved["model_config"]) == config
    assert warm_start.resume_conflict(tmp_path, config, spec) is None
    assert "embedding.table_widths" in warm_start.resume_conflict(tmp_path, TINY, spec)


def test_periodic_eval_and_pruned_checkpoints(data, tmp_path):
    config = dataclasses.replace(CONFIG, eval_every=2, checkpoint_every=2, keep_checkpoints=2)
    _, result = train(data.open(), data.plans[1], TINY, config, checkpoint_dir=tmp_path)
    assert result.eval_steps == [2, 4, 6]
    assert checkpoint_steps(tmp_path) == [4, 6]
    state = load_checkpoint(tmp_path).state
    assert state["step"] == 6 and len(state["losses"]) == 6
    optimizer_state = state["optimizer"]["state"]
    table = optimizer_state["sparse.embeddings.sequence.embeddings.item.weight"]
    assert table["sum"].shape == (TINY.embedding.item_buckets, 1)  # row-wise Adagrad: one accumulator per row
    assert {"exp_avg", "exp_avg_sq"} <= set(optimizer_state["dense.trunk.0.weight"])


def test_warm_start_loads_the_earlier_weights(data, tmp_path):
    first, _ = train(data.open(), data.plans[1], TINY, dataclasses.replace(CONFIG, max_steps=2),
                     checkpoint_dir=tmp_path / "a")
    config = dataclasses.replace(CONFIG, max_steps=1, lr_dense=0.0, lr_sparse=0.0)
    second, result = train(data.open(), data.plans[1], TINY, config, checkpoint_dir=tmp_path / "b",
                           warm_start=tmp_path / "a")
    assert result.resumed_from is None and result.steps == 1
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items()):
        torch.testing.assert_close(a, b, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("bias_there", [True, False])
def test_a_warm_start_between_models_with_and_without_biases_is_refused_by_name(data, tmp_path, bias_there):
    # Same shapes wherever both have a weight: loaded, the biases would be dropped or left at their start.
    models = [dataclasses.replace(TINY, sequence=dataclasses.replace(TINY.sequence, qkv_bias=b))
              for b in (bias_there, not bias_there)]
    one_step = dataclasses.replace(CONFIG, max_steps=1)
    train(data.open(), data.plans[1], models[0], one_step, checkpoint_dir=tmp_path / "a")
    weights = "of its weights have no place here" if bias_there else "weights are not in it"
    with pytest.raises(ValueError, match=rf"cannot warm-start .*{weights} .*sequence.qkv_bias: {bias_there} there"):
        train(data.open(), data.plans[1], models[1], CONFIG, checkpoint_dir=tmp_path / "b", warm_start=tmp_path / "a")


def test_diverging_loss_stops_with_a_clear_error(data, tmp_path):
    with pytest.raises(FloatingPointError, match="lower lr_dense"):
        train(data.open(), data.plans[1], TINY,
              dataclasses.replace(CONFIG, lr_dense=1e30, warmup_steps=1, clip_grad_norm=0))


# Read late (the next step queued first), step 1 runs on step 0's broken weights and every gradient is non-finite by
# the time step 0 is read: the one named is the one flagged on the device when step 0 was queued.
@pytest.mark.parametrize("readout, named", [("each_step", r".*trunk\.0\.weight"),
                                            ("next_step", r"trunk\.0\.weight; .*steps read late")])
@pytest.mark.parametrize("clip", [1.0, 0.0])
def test_a_non_finite_gradient_stops_the_step_it_appears_in_and_is_named(data, clip, readout, named):
    from gem_ops.model.config import FeatureSpec
    from gem_ops.train.model_state import seeded_model

    logs = data.open()
    model = seeded_model(FeatureSpec.from_logs(logs), TINY)
    model.trunk[0].weight.register_hook(lambda grad: grad * float("inf"))  # the loss itself stays finite
    with pytest.raises(FloatingPointError, match=r"at step 0: loss [0-9.]+, dense gradient norm (nan|inf); "
                                                 r"non-finite gradients in " + named):
        train(logs, data.plans[1], TINY, dataclasses.replace(CONFIG, clip_grad_norm=clip, step_readout=readout),
              model=model)


@pytest.mark.parametrize("readout", ["each_step", "next_step"])
def test_a_nan_gradient_is_named_alone_though_clipping_spreads_it(data, readout):
    """With clipping on, a NaN gradient makes the total norm NaN and clipping scales every gradient by NaN: the
    parameter named is the one whose own gradient broke, flagged before the clipping, not every dense one."""
    from gem_ops.model.config import FeatureSpec
    from gem_ops.train.model_state import seeded_model

    logs = data.open()
    model = seeded_model(FeatureSpec.from_logs(logs), TINY)
    model.trunk[0].weight.register_hook(lambda grad: grad * float("nan"))
    with pytest.raises(FloatingPointError, match=r"dense gradient norm nan; non-finite gradients in trunk\.0\.weight"
                                                 r"(;|$)"):
        train(logs, data.plans[1], TINY, dataclasses.replace(CONFIG, clip_grad_norm=1.0, step_readout=readout),
              model=model)


def test_output_biases_start_at_the_plan_label_rates(data):
    from gem_ops.model.config import FeatureSpec
    from gem_ops.train.initialization import init_output_biases, plan_examples
    from gem_ops.train.model_state import seeded_model

    logs = data.open()
    model = seeded_model(FeatureSpec.from_logs(logs), model_config("vertical"))
    assert init_output_biases(model, logs, data.plans[1])
    batch = logs.batch(plan_examples(data.plans[1]), max_history_len=0)
    bias = model.towers.biases[-1].view(len(logs.surfaces), len(logs.objectives))
    checked = 0
    for d in range(len(logs.surfaces)):
        for t in range(len(logs.objectives)):
            labelled = batch.label_mask[:, t] & (batch.surface == d)
            n = int(labelled.sum())
            if n > 100:
                # the label rate, shrunk toward the task's overall rate by 100 pseudo-examples
                overall = float(batch.labels[batch.label_mask[:, t], t].mean())
                rate = (float(batch.labels[labelled, t].sum()) + 100 * overall) / (n + 100)
                assert torch.sigmoid(bias[d, t]).item() == pytest.approx(rate, rel=1e-4)
                checked += 1
    assert checked >= 4


def test_sparse_table_gradients_option_trains_the_same(data):
    """TrainConfig.sparse_table_gradients: the tables return sparse gradients and only the rows looked
    up are updated; the same training as whole-table updates (off by default: slower on the H200)."""
    logs = data.open()
    config = dataclasses.replace(CONFIG, max_steps=3)
    dense_model, dense = train(logs, data.plans[1], TINY, config)
    sparse_model, sparse = train(logs, data.plans[1], TINY, dataclasses.replace(config, sparse_table_gradients=True))
    tables = [m for m in sparse_model.modules() if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))]
    assert tables and all(m.sparse for m in tables)
    assert not any(m.sparse for m in dense_model.modules()
                   if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)))
    assert sparse.losses == pytest.approx(dense.losses, rel=1e-4)


def test_the_plan_is_balanced_for_the_history_length_the_model_reads(data, caplog):
    """The stored plan was balanced for histories of 32 events; a model that reads 4 gets the same examples
    balanced again for 4 (one setting: the model's), logged, the same on every rank."""
    import numpy as np

    from gem_ops.data.batch_shuffling import ShufflingConfig, plan_base_batch_shuffling, plan_info, read_plan
    from gem_ops.train.batches import rank_schedule

    logs = data.open()
    assert plan_info(data.plans[1])["max_history_len"] == 32
    stored = read_plan(data.plans[1])
    with caplog.at_level("INFO", logger="gem_ops.train.batches"):
        schedule = rank_schedule(logs, data.plans[1], 0, 1, epochs=1, seed=0, max_history_len=4)
    assert "balanced again for 4" in caplog.text
    assert np.array_equal(np.sort(schedule.steps.reshape(-1)), np.sort(stored.reshape(-1)))  # the same examples
    examples = np.sort(stored.reshape(-1))
    again = plan_base_batch_shuffling(logs.history_lengths(4)[examples], 1,
                                      ShufflingConfig(**plan_info(data.plans[1])["shuffling"]), examples)
    assert np.array_equal(schedule.steps, again.examples[:, 0]) and not np.array_equal(schedule.steps, stored[:, 0])
    same = rank_schedule(logs, data.plans[1], 0, 1, epochs=1, seed=0, max_history_len=32)
    assert np.array_equal(same.steps, stored[:, 0])  # the model reads what the plan was balanced for


def test_early_stopping_keeps_the_best_weights_and_stops_when_patience_runs_out(data, tmp_path):
    """With frozen weights (no learning rate) the validation NE never improves after the first evaluation:
    patience 1 stops at the second, and the first evaluation's step is kept."""
    config = dataclasses.replace(CONFIG, max_steps=10, lr_dense=0.0, lr_sparse=0.0, validation_days=1, eval_every=2,
                                 early_stopping_patience=1, calibrate=False)
    _, result = train(data.open(), data.plans[1], TINY, config, checkpoint_dir=tmp_path)
    assert result.stopped_early and result.steps == 4 and result.validation_steps == [2, 4]
    assert result.best_step == 2
    assert checkpoint_steps(tmp_path / "best") == [2]


def test_early_stopping_waits_for_its_minimum_steps(data, tmp_path):
    """The same frozen training with early_stopping_min_steps=8 goes on to step 8, keeping step 2."""
    config = dataclasses.replace(CONFIG, max_steps=10, lr_dense=0.0, lr_sparse=0.0, validation_days=1, eval_every=2,
                                 early_stopping_patience=1, early_stopping_min_steps=8, calibrate=False)
    _, result = train(data.open(), data.plans[1], TINY, config, checkpoint_dir=tmp_path)
    assert result.stopped_early and result.steps == 8 and result.validation_steps == [2, 4, 6, 8]
    assert result.best_step == 2


def test_the_kept_weights_are_the_best_validated_ones(data, tmp_path):
    from gem_ops.train.engine import validation_ne
    from gem_ops.train.evaluation import evaluate

    logs = data.open()
    config = dataclasses.replace(CONFIG, max_steps=8, lr_dense=3e-2, validation_days=1, eval_every=2, calibrate=False)
    model, result = train(logs, data.plans[1], TINY, config)
    scores = [validation_ne(r, ("click", "conversion")) for r in result.validation_reports]
    best = result.validation_steps[scores.index(min(scores))]
    assert result.best_step == best and result.validation_steps == [2, 4, 6, 8]
    from gem_ops.train.batches import newest_days

    again = evaluate(model, logs, config, torch.device("cpu"), newest_days(logs, data.plans[1], 1))
    assert again["all/click"]["ne"] == pytest.approx(
        result.validation_reports[scores.index(min(scores))]["all/click"]["ne"])


def test_validation_day_is_held_out_of_training_and_calibration_is_fitted_on_it(data):
    import numpy as np

    from gem_ops.train.batches import newest_days, rank_schedule
    from gem_ops.train.evaluation import gathered_predictions

    logs = data.open()
    held_out = newest_days(logs, data.plans[1], 1)
    day = logs.column("timestamp")[held_out] // 86_400_000
    assert held_out.size and (day == day.max()).all()
    schedule = rank_schedule(logs, data.plans[1], 0, 1, 1, 0, 16, held_out=held_out)
    assert not np.isin(schedule.steps, held_out).any()

    config = dataclasses.replace(CONFIG, max_steps=6, validation_days=1, eval_every=3, eval_max_examples=100_000)
    model, result = train(logs, data.plans[1], TINY, config)
    scale = torch.tensor(result.calibration["scale"])
    assert scale.shape == (len(logs.surfaces), len(logs.objectives)) and not torch.all(scale == 1)
    assert torch.equal(model.output_calibration.calibration[0], scale)
    out = gathered_predictions(model, logs, config, torch.device("cpu"), held_out)
    for t in range(len(logs.objectives)):  # calibrated where it was fitted: mean prediction = mean label
        rows = out["label_mask"][:, t]
        mean_p = float(torch.sigmoid(out["logits"][rows, t]).mean())
        assert mean_p == pytest.approx(float(out["labels"][rows, t].mean()), rel=0.05)


def test_platt_scaling_recovers_a_known_miscalibration():
    import numpy as np

    from gem_ops.train.calibration import platt_scaling

    rng = np.random.default_rng(0)
    z = rng.normal(size=20_000)
    y = rng.random(20_000) < 1 / (1 + np.exp(-(2.0 * z - 1.0)))
    a, b = platt_scaling(z, y)
    assert a == pytest.approx(2.0, abs=0.1) and b == pytest.approx(-1.0, abs=0.1)
    assert platt_scaling(z[:5], np.zeros(5)) [0] == pytest.approx(1.0, abs=0.2)  # few labels: near identity


def test_validation_ne_pools_the_objectives_by_their_labels():
    from gem_ops.train.engine import validation_ne

    report = {"all/click": {"ne": 0.9, "log_loss": 0.09, "count": 1000},  # entropy 0.1 per example
              "all/conversion": {"ne": 2.0, "log_loss": 0.02, "count": 100},  # entropy 0.01: few bits
              "all/other": {"ne": float("nan"), "log_loss": 0.0, "count": 10}}
    assert validation_ne(report, ("click", "conversion", "other")) == pytest.approx((90 + 2) / (100 + 1))
    assert validation_ne({}, ("click",)) == float("inf")


def test_cosine_schedule_warms_up_then_decays_to_its_floor():
    from gem_ops.train.optimizer import set_dense_lr

    class Opt:
        optimizers = [("dense", torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0))]

    config = TrainConfig(lr_dense=1.0, warmup_steps=10, lr_schedule="cosine", min_lr_ratio=0.1)
    lrs = [set_dense_lr(Opt, config, step, 110) for step in range(110)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[60] == pytest.approx(0.55, abs=0.01) and lrs[-1] == pytest.approx(0.1, abs=0.001)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))


def test_warmup_share_cuts_a_short_runs_warmup_only():
    from gem_ops.train.optimizer import set_dense_lr, warmup_steps

    class Opt:
        optimizers = [("dense", torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0))]

    shared = TrainConfig(lr_dense=1.0, warmup_steps=20, warmup_share=0.1, lr_schedule="cosine")
    assert warmup_steps(shared, 28) == 3 and warmup_steps(shared, 1000) == 20  # a long run keeps its 20
    assert warmup_steps(TrainConfig(warmup_steps=20), 28) == 20
    lrs = [set_dense_lr(Opt, shared, step, 28) for step in range(28)]
    assert lrs[2] == pytest.approx(1.0) and lrs[1] < 1.0 and lrs[-1] < 0.2
    with pytest.raises(ValueError, match="warmup_share"):
        TrainConfig(warmup_share=1.5)


def test_platt_scaling_stays_finite_on_separable_and_one_class_groups():
    import numpy as np

    from gem_ops.train.calibration import platt_scaling

    separable = platt_scaling(np.array([-3.0, -2.0, 2.0, 3.0]), np.array([0, 0, 1, 1]))
    only_negatives = platt_scaling(np.linspace(-1, 1, 50), np.zeros(50))
    extreme = platt_scaling(np.array([-40.0, 40.0, 35.0]), np.array([1, 0, 0]))
    for a, b in (separable, only_negatives, extreme):
        assert np.isfinite(a) and np.isfinite(b) and abs(a) < 50 and abs(b) < 50
    assert only_negatives[1] < -1  # pushed toward predicting no positives, as far as the prior lets it


def test_a_checkpoint_write_failing_for_want_of_space_leaves_the_previous_one_valid(data, tmp_path, monkeypatch):
    """The disk fills while step 4's checkpoint is written (every write into its folder fails with ENOSPC,
    shards included): the job fails with that error, step 2's checkpoint stays the latest and loads, and
    the run started again resumes from it, finishes, and leaves no half-written folder."""
    import errno

    config = dataclasses.replace(CONFIG, checkpoint_every=2, keep_checkpoints=3)
    save = torch.save

    def save_until_the_disk_is_full(obj, f, *args, **kwargs):
        if (tmp_path / ".step_00000004.partial").exists():  # step 4's checkpoint is being written
            raise OSError(errno.ENOSPC, "No space left on device")
        return save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_until_the_disk_is_full)
    with pytest.raises(BaseException) as failed:  # DCP's CheckpointException is a BaseException
        train(data.open(), data.plans[1], TINY, config, checkpoint_dir=tmp_path)
    # DCP reports its writers' errors per rank: (exception, traceback) in CheckpointException.failures.
    errors = [failed.value, *(f[0] if isinstance(f, tuple) else f
                              for f in getattr(failed.value, "failures", {}).values())]
    assert any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in errors), errors
    monkeypatch.setattr(torch, "save", save)
    assert checkpoint_steps(tmp_path) == [2] and load_checkpoint(tmp_path).step == 2
    _, result = train(data.open(), data.plans[1], TINY, config, checkpoint_dir=tmp_path)
    assert result.resumed_from == 2 and result.steps == 6 and checkpoint_steps(tmp_path) == [2, 4, 6]
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_mlflow_going_away_mid_run_fails_the_job_loudly_and_the_rerun_logs_every_step(data, tmp_path, monkeypatch):
    """The tracking server stops during training: the job fails with MLflow's error (within seconds, with
    MLflow's retries set low) rather than training on with its metrics dropped; run again against the
    restarted server, it resumes from its checkpoint and the run holds a loss for every step."""
    import sys
    import time

    from gem_ops import tracking
    from gem_ops.tracking import RunTracker, ensure_experiment
    from tests.servers import free_port, start_server, stop_server

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, str(tracking.PROJECT_ROOT / "mlflow" / "server.py"), "--port", str(port),
               "--backend-store-uri", f"sqlite:///{tmp_path / 'm.db'}", "--artifact-root", str(tmp_path / "artifacts")]
    server = start_server(command, f"{url}/health", timeout=120)
    client = tracking.tracking_client(url)
    run_id = client.create_run(ensure_experiment(client, "gem")).info.run_id
    config = dataclasses.replace(CONFIG, checkpoint_every=2, log_every=1)

    def stop_at_step_3(step, loss):
        if step == 3:
            stop_server(server)

    began = time.monotonic()
    try:
        with pytest.raises(Exception, match="127.0.0.1"):
            train(data.open(), data.plans[1], TINY, config, checkpoint_dir=tmp_path / "ckpt",
                  tracker=RunTracker(client, run_id), step_hooks=[stop_at_step_3])
    finally:
        stop_server(server)
    assert time.monotonic() - began < 120
    server = start_server(command, f"{url}/health", timeout=120)
    try:
        _, result = train(data.open(), data.plans[1], TINY, config, checkpoint_dir=tmp_path / "ckpt",
                          tracker=RunTracker(client, run_id))
        assert result.resumed_from == 2 and result.steps == 6
        assert sorted({m.step for m in client.get_metric_history(run_id, "train.loss")}) == list(range(6))
    finally:
        stop_server(server)


def test_warming_up_every_length_bucket_leaves_training_unchanged(data, monkeypatch):
    import gem_ops.train.engine as engine
    from gem_ops.train.warm_up import length_buckets

    assert length_buckets(1024) == [16, 32, 64, 128, 256, 512, 1024] and length_buckets(48) == [16, 32, 48]
    assert length_buckets(8) == [8]
    ran, accumulated = [], []

    def warm_up_lengths(self, run=engine.Trainer.warm_up_lengths):
        # A parameter's hook runs before its gradient is accumulated: each pass finds none there (under CUDA graphs
        # the pass before's gradient lives in memory its graphs own).
        hooks = [p.register_hook(lambda g, p=p: accumulated.append(p.grad is not None))
                 for p in self.module.parameters() if p.requires_grad]
        try:
            ran.append(run(self))
        finally:
            for hook in hooks:
                hook.remove()
        return ran[-1]

    monkeypatch.setattr(engine.Trainer, "warm_up_lengths", warm_up_lengths)
    config = model_config("vertical", width=0.5, **{"sequence.max_history_len": 32})
    plain_model, plain = train(data.open(), data.plans[1], config, CONFIG)
    warm_model, warm = train(data.open(), data.plans[1], config, dataclasses.replace(CONFIG, warm_up_lengths=True))
    assert ran == [[16, 32]]  # one zero-loss pass per bucket, then the same run
    assert accumulated and not any(accumulated)
    assert warm.losses == plain.losses
    for (name, a), (_, b) in zip(plain_model.state_dict().items(), warm_model.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
def test_a_run_under_cuda_graphs_reports_the_graphs_run_without_them(data):
    """On the CPU Inductor records no CUDA graph: both compiled regions of the step (the history tokens, the step
    after the lookups) are reported as run without one (about 40 s of compiling on the CPU)."""
    _, result = train(data.open(), data.plans[1], TINY, dataclasses.replace(CONFIG, compile="model", cuda_graphs=True))
    assert result.cuda_graph_skips == 2 and result.cuda_graph_skip_reasons == []
    assert result.to_dict()["cuda_graph_skips"] == 2
