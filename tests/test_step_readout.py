"""Steps read one step late: the next step is queued before the host reads the previous one's figures, the run
trains and reports exactly what a run read step by step does, evaluations and checkpoints see the weights of the step
they name (a diverging step read late: tests/test_training.py)."""

import dataclasses

import pytest
import torch

from gem_ops.model.config import FeatureSpec, model_config
from gem_ops.train.checkpoint import checkpoint_steps, load_checkpoint
from gem_ops.train.config import TrainConfig
from gem_ops.train.engine import train
from gem_ops.train.model_state import seeded_model
from gem_ops.train.step_readout import HOST_PHASES, host_phase_seconds, read_at_once, reads_late
from tests.training_data import learnable_data

TINY = model_config("vertical", width=0.5, **{"sequence.max_history_len": 16})
CONFIG = TrainConfig(max_steps=7, eval_max_examples=128, log_every=2, warmup_steps=2)
LATE, AT_ONCE = (dataclasses.replace(CONFIG, step_readout=r) for r in ("next_step", "each_step"))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return learnable_data(tmp_path_factory.mktemp("readout"), days=4, eval_days=1, max_history_len=32,
                          sub_batch_size=16, n_users=300)


def forwards_seen_by_each_step_hook(data, config: TrainConfig) -> dict[int, int]:
    """{step: forwards run when its step hook ran}."""
    logs = data.open()
    model = seeded_model(FeatureSpec.from_logs(logs), TINY)
    forwards, seen = [0], {}
    # Training forwards only: evaluations run the trunk too, in eval mode.
    model.trunk.register_forward_pre_hook(lambda module, args: forwards.__setitem__(0, forwards[0] + module.training))
    train(logs, data.plans[1], TINY, config, model=model, step_hooks=[lambda step, loss: seen.setdefault(
        step, forwards[0])])
    return seen


def test_the_next_step_is_queued_before_a_step_is_read_except_where_the_host_acts_on_the_model(data):
    config = dataclasses.replace(LATE, eval_every=3)
    seen = forwards_seen_by_each_step_hook(data, config)
    # Steps 2 and 5 are followed by an evaluation (its forwards come after the hook), step 6 is the last.
    assert seen == {0: 2, 1: 3, 2: 3, 3: 5, 4: 6, 5: 6, 6: 7}
    assert forwards_seen_by_each_step_hook(data, dataclasses.replace(AT_ONCE, eval_every=3)) == {
        step: step + 1 for step in range(7)}


def test_a_run_read_late_trains_and_reports_what_a_run_read_at_once_does(data, tmp_path):
    logs = data.open()
    runs = {}
    for name, config in (("late", LATE), ("at_once", AT_ONCE)):
        config = dataclasses.replace(config, eval_every=3, checkpoint_every=2)
        runs[name] = train(logs, data.plans[1], TINY, config, checkpoint_dir=tmp_path / name)
    (late_model, late), (model, at_once) = runs["late"], runs["at_once"]
    assert late.losses == at_once.losses and late.steps == at_once.steps == 7
    assert late.eval_steps == at_once.eval_steps == [3, 6, 7]
    assert late.eval_reports == at_once.eval_reports  # evaluated on the weights of the step named
    assert len(late.step_seconds) == len(late.step_ends) == 7 and all(s > 0 for s in late.step_seconds)
    assert checkpoint_steps(tmp_path / "late") == checkpoint_steps(tmp_path / "at_once")
    for step_dir in ("late", "at_once"):
        assert load_checkpoint(tmp_path / step_dir).state["losses"] == at_once.losses
    for (name, a), (_, b) in zip(late_model.state_dict().items(), model.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def test_which_runs_read_late_and_which_steps_are_read_at_once():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert reads_late("auto", cuda) and not reads_late("auto", cpu)
    assert reads_late("next_step", cpu) and not reads_late("each_step", cuda)
    assert [s for s in range(10) if read_at_once(s, 10, eval_every=4, checkpoint_every=3)] == [2, 3, 5, 7, 8, 9]
    with pytest.raises(ValueError, match="step_readout"):
        TrainConfig(step_readout="later")


def test_the_time_a_step_waits_to_be_read_back_is_recorded(data, monkeypatch):
    """TrainResult.step_read_waits: the host's time blocked reading each step back (here a read held 30 ms)."""
    import time

    import gem_ops.train.engine as engine

    read = engine.read_figures
    monkeypatch.setattr(engine, "read_figures", lambda queued: (time.sleep(0.03), read(queued))[1])
    result = train(data.open(), data.plans[1], TINY, AT_ONCE)[1]
    assert len(result.step_read_waits) == result.steps == CONFIG.max_steps
    assert all(0.03 <= w <= s for w, s in zip(result.step_read_waits, result.step_seconds))


def test_the_hosts_time_in_each_phase_of_a_step_is_recorded(data, monkeypatch):
    """TrainResult.step_host_seconds: per step, the host's time queuing its data, forward, backward and optimizer
    (here the optimizer's clipping held 100 ms, in that phase alone)."""
    import time

    import gem_ops.train.engine as engine

    clip = engine.clip_dense_gradients
    monkeypatch.setattr(engine, "clip_dense_gradients", lambda *a: (time.sleep(0.1), clip(*a))[1])
    result = train(data.open(), data.plans[1], TINY, LATE)[1]
    assert len(result.step_host_seconds) == result.steps == CONFIG.max_steps
    for phases, wall in zip(result.step_host_seconds, result.step_seconds):
        assert tuple(phases) == HOST_PHASES and all(s >= 0 for s in phases.values())
        assert phases["optimizer"] >= 0.1 and phases["forward"] < 0.1 and phases["backward"] < 0.1
    # The phases lie inside the step's wall time from the previous read (steps read late: a step after the first
    # is timed from the previous read, which comes after this step's phases were queued, so the first alone).
    assert sum(result.step_host_seconds[0].values()) <= result.step_seconds[0]
    assert result.to_dict()["step_host_seconds"] == result.step_host_seconds


def test_host_phase_seconds_are_the_gaps_between_the_marks():
    assert host_phase_seconds(1.0, [1.5, 3.0, 6.0, 6.25]) == {"data": 0.5, "forward": 1.5, "backward": 3.0,
                                                               "optimizer": 0.25}
    with pytest.raises(ValueError, match="4 marks expected"):
        host_phase_seconds(1.0, [2.0])


def test_bucketed_sizes_train_what_exact_sizes_do(data, monkeypatch):
    """TrainConfig.size_bucket: every batch padded to bucketed sizes (rows of no example past the last), the same
    losses step by step."""
    import gem_ops.train.engine as engine

    logs, spare_rows = data.open(), []
    built = engine.model_input

    def recording(*args, **kwargs):
        x = built(*args, **kwargs)
        spare_rows.append(x.history_action.numel() - int(x.history_offsets[-1]))
        return x

    monkeypatch.setattr(engine, "model_input", recording)
    runs = {}
    for bucket in (0.0, 1.5):
        spare_rows.clear()
        runs[bucket] = train(logs, data.plans[1], TINY, dataclasses.replace(CONFIG, size_bucket=bucket))[1]
        assert (max(spare_rows) > 0) == bool(bucket) and len(spare_rows) >= CONFIG.max_steps
    assert runs[1.5].losses == pytest.approx(runs[0.0].losses, rel=1e-5)
    # The warm-up's inputs bucketed as the steps' are: a padded input compiles another graph than an exact one.
    from gem_ops.train.warm_up import warm_up_inputs

    warm = [x for _, x in warm_up_inputs(logs, FeatureSpec.from_logs(logs), TINY, size_bucket=1.5)]
    assert warm and all(x.padded for x in warm)
    with pytest.raises(ValueError, match="size_bucket must be 0"):
        TrainConfig(size_bucket=0.5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_steps_read_late_train_what_steps_read_at_once_do(data):
    logs = data.open()
    runs = {r: train(logs, data.plans[1], TINY, dataclasses.replace(CONFIG, step_readout=r), device="cuda")[1]
            for r in ("auto", "each_step")}
    assert runs["auto"].losses == pytest.approx(runs["each_step"].losses, rel=1e-5)  # auto: late on one GPU
    assert runs["auto"].step_seconds and all(s > 0 for s in runs["auto"].step_seconds)


def _gather_through_a_host_group(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    from gem_ops.train import step_balance

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        real = dist.get_backend
        dist.get_backend = lambda group=None: "nccl"  # as under a GPU job: a gloo group of its own is made
        group = step_balance.host_group()
        dist.get_backend = real
        assert group is not None and dist.get_backend(group) == "gloo"
        rows = step_balance.gather_rows([rank, 10.0 * rank], group)
        torch.save(torch.from_numpy(rows), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_ranks_gather_their_figures_through_a_gloo_group_made_beside_the_jobs_own(tmp_path):
    world = 2
    torch.multiprocessing.spawn(_gather_through_a_host_group, args=(world, f"file://{tmp_path / 'rdzv'}",
                                                                    str(tmp_path / "rows")), nprocs=world)
    for rank in range(world):
        assert torch.load(tmp_path / f"rows.{rank}").tolist() == [[0.0, 0.0], [1.0, 10.0]]
