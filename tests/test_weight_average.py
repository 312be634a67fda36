"""The weight average: its update, its swap, and the engine judging, keeping and resuming it."""

import dataclasses

import pytest
import torch
from torch import nn

from gem_ops.train.engine import train
from gem_ops.train.weight_average import WeightAverage, local_weight_tensors
from tests.test_training import CONFIG, TINY, data  # noqa: F401  (the module's data fixture)


def test_update_follows_the_ramped_decay_and_the_swap_restores_the_live_weights():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    model[1].weight = model[0].weight  # tied: averaged once
    assert len(local_weight_tensors(model)) == 3
    average = WeightAverage(model, decay=0.9)
    expected = model[0].weight.detach().clone()
    for n in range(4):
        with torch.no_grad():
            model[0].weight.add_(1.0)
        average.update()
        d = min(0.9, (1 + n) / (10 + n))
        expected = d * expected + (1 - d) * model[0].weight.detach()
    live = model[0].weight.detach().clone()
    with average.swapped_in():
        torch.testing.assert_close(model[0].weight.detach(), expected)
        torch.testing.assert_close(model[1].weight.detach(), expected)
    assert torch.equal(model[0].weight.detach(), live)
    average.keep()
    torch.testing.assert_close(model[0].weight.detach(), expected)


def test_a_bad_decay_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match="weight_average_decay"):
        dataclasses.replace(CONFIG, weight_average_decay=1.0)
    with pytest.raises(ValueError, match="weight_average_decay"):
        WeightAverage(nn.Linear(2, 2), decay=0.0)


def test_training_keeps_the_average_of_its_steps_weights(data):  # noqa: F811
    """Two steps at decay 0.5: 0.1 of the start and 0.9 of step 1's weights, then 2/11 of that and 9/11 of step 2's."""
    logs, plan = data.open(), data.plans[1]
    start, _ = train(logs, plan, TINY, dataclasses.replace(CONFIG, max_steps=1, lr_dense=0.0, lr_sparse=0.0))
    one, _ = train(logs, plan, TINY, dataclasses.replace(CONFIG, max_steps=1))
    two, _ = train(logs, plan, TINY, dataclasses.replace(CONFIG, max_steps=2))
    averaged, _ = train(logs, plan, TINY, dataclasses.replace(CONFIG, max_steps=2, weight_average_decay=0.5))
    states = [m.state_dict() for m in (start, one, two, averaged)]
    moved = 0
    for name, value in states[3].items():
        if not torch.is_floating_point(value):
            continue
        w0, w1, w2 = (s[name] for s in states[:3])
        expected = (2 / 11) * (0.1 * w0 + 0.9 * w1) + (9 / 11) * w2
        torch.testing.assert_close(value, expected, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
        moved += int(not torch.allclose(value, w2))
    assert moved > 0  # the kept weights are not the last step's


def test_a_resumed_run_resumes_its_average(data, tmp_path):  # noqa: F811
    config = dataclasses.replace(CONFIG, weight_average_decay=0.8, checkpoint_every=3)
    logs, plan = data.open(), data.plans[1]
    whole, _ = train(logs, plan, TINY, config, checkpoint_dir=tmp_path / "whole")

    def killed(step, loss):
        if step == 4:
            raise KeyboardInterrupt("killed")

    with pytest.raises(KeyboardInterrupt):  # after the checkpoint of step 3
        train(logs, plan, TINY, config, checkpoint_dir=tmp_path / "resumed", step_hooks=[killed])
    resumed, result = train(logs, plan, TINY, config, checkpoint_dir=tmp_path / "resumed")
    assert result.resumed_from == 3
    for (name, a), (_, b) in zip(whole.state_dict().items(), resumed.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4, msg=lambda m: f"{name}: {m}")


def test_validation_judges_the_average_and_the_best_average_is_kept(data):  # noqa: F811
    from gem_ops.train.batches import newest_days
    from gem_ops.train.engine import validation_ne
    from gem_ops.train.evaluation import evaluate

    logs, plan = data.open(), data.plans[1]
    config = dataclasses.replace(CONFIG, max_steps=8, lr_dense=3e-2, validation_days=1, eval_every=2, calibrate=False,
                                 weight_average_decay=0.5)
    model, result = train(logs, plan, TINY, config)
    scores = [validation_ne(r, ("click", "conversion")) for r in result.validation_reports]
    best = scores.index(min(scores))
    again = evaluate(model, logs, config, torch.device("cpu"), newest_days(logs, plan, 1))
    assert again["all/click"]["ne"] == pytest.approx(result.validation_reports[best]["all/click"]["ne"])
    plain, _ = train(logs, plan, TINY, dataclasses.replace(config, weight_average_decay=0.0))
    plain_ne = evaluate(plain, logs, config, torch.device("cpu"), newest_days(logs, plan, 1))["all/click"]["ne"]
    assert again["all/click"]["ne"] != pytest.approx(plain_ne)  # the average, not the plain run's weights
