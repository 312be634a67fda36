"""Python's garbage collector on the training schedule: no automatic collection inside a step, a collection of
what the steps made every gc_every steps, the collector as it was afterwards."""

import dataclasses
import gc
import weakref

import pytest

from gem_ops.data.synthetic import STRONG_SIGNAL
from gem_ops.model.config import model_config
from gem_ops.train.config import TrainConfig
from gem_ops.train.engine import train
from gem_ops.train.gc_schedule import CollectionPauses, CollectionSchedule
from tests.training_data import learnable_data


class _Cycle:
    def __init__(self):
        self.me = self


@pytest.fixture
def collector_restored():
    enabled = gc.isenabled()
    yield
    gc.unfreeze()
    (gc.enable if enabled else gc.disable)()


def test_a_cycle_made_during_the_steps_lives_until_the_scheduled_collection(collector_restored):
    gc.enable()
    schedule = CollectionSchedule(every=3)
    schedule.start()
    try:
        assert not gc.isenabled() and gc.get_freeze_count() > 0  # what lived before is frozen
        cycle = weakref.ref(_Cycle())
        for step in range(2):
            schedule.after_step(step)
            assert cycle() is not None  # no collection between the scheduled ones
        schedule.after_step(2)
        assert cycle() is None
    finally:
        schedule.stop()
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_what_survives_a_scheduled_collection_is_not_walked_by_the_next(collector_restored):
    """After a first full collection (the first steps' compile garbage), the scheduled collections walk the young
    generations: what outlived one moves to the oldest generation, which they do not walk again."""
    schedule = CollectionSchedule(every=1)
    generations = []

    def record(phase, info):
        if phase == "start":
            generations.append(info["generation"])

    schedule.start()
    gc.callbacks.append(record)
    try:
        survivor = [_Cycle()]
        schedule.after_step(0)
        assert any(x is survivor for x in gc.get_objects(generation=2))
        schedule.after_step(1)
        schedule.after_step(2)
    finally:
        gc.callbacks.remove(record)
        schedule.stop()
    assert generations == [2, 1, 1]


def test_every_zero_leaves_automatic_collection_alone(collector_restored):
    gc.enable()
    schedule = CollectionSchedule(every=0)
    schedule.start()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    schedule.after_step(0)
    schedule.stop()
    assert gc.isenabled()


def test_a_collector_off_before_training_stays_off(collector_restored):
    gc.disable()
    schedule = CollectionSchedule(every=2)
    schedule.start()
    schedule.stop()
    assert not gc.isenabled()


def test_objects_a_caller_froze_stay_frozen(collector_restored):
    gc.freeze()
    frozen = gc.get_freeze_count()
    schedule = CollectionSchedule(every=2)
    schedule.start()
    schedule.stop()
    assert gc.get_freeze_count() == frozen


def test_pauses_count_the_seconds_of_each_collection():
    with CollectionPauses() as pauses:
        garbage = [_Cycle() for _ in range(20_000)]
        del garbage
        gc.collect()
    assert pauses.seconds > 0
    seen = pauses.seconds
    gc.collect()  # after leaving: no longer counted
    assert pauses.seconds == seen


def test_negative_gc_every_names_the_setting():
    with pytest.raises(ValueError, match="TrainConfig.gc_every"):
        TrainConfig(gc_every=-1)


def test_the_engine_trains_with_automatic_collection_off_and_restores_it(tmp_path, collector_restored):
    gc.enable()
    small = dataclasses.replace(STRONG_SIGNAL, n_users=200)
    data = learnable_data(tmp_path / "data", small, days=3, eval_days=1, max_history_len=16, sub_batch_size=16)
    config = TrainConfig(max_steps=4, eval_max_examples=64, gc_every=2, warmup_steps=1)
    enabled, frozen, alive_made = [], [], []
    made = []

    def on_step(step, loss):
        enabled.append(gc.isenabled())
        frozen.append(gc.get_freeze_count() > 0)  # what lived before the first step: not walked by collections
        if step == 0:
            made.append(weakref.ref(_Cycle()))
        alive_made.append(made[0]() is not None)

    pauses = CollectionPauses()
    pauses.start()
    result = train(data.open(), data.plans[1], model_config("vertical", width=0.25, **{"sequence.max_history_len": 16}),
                   config, checkpoint_dir=tmp_path / "ckpt", step_hooks=[on_step])[1]
    pauses.stop()
    assert 0 < result.gc_seconds <= pauses.seconds  # the two scheduled collections, among the run's
    assert enabled == [False] * 4
    assert frozen == [True] * 4
    assert alive_made == [True, True, False, False]  # made in step 0, collected after step 1 (gc_every=2)
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_an_mfu_window_records_what_stalled_each_step():
    import torch

    from gem_ops.train.mfu_window import MFUWindow

    window = MFUWindow(steps=3, warmup_steps=0, profile_steps=0)
    with window.observe(torch.device("cpu"), profile=False) as observer:
        observer(0, 0.0)
        compiled = torch.compile(lambda x: x * 2 + 1, backend="eager")
        compiled(torch.ones(3))  # in step 1: one new graph
        observer(1, 0.0)
        garbage = [_Cycle() for _ in range(20_000)]
        del garbage
        gc.collect()  # in step 2: a collection
        from torch._dynamo.utils import counters

        # and a CUDA graph recorded, as Inductor counts one
        counters["inductor"]["cudagraph_recorded_non_static_inputs"] += 3
        observer(2, 0.0)
    stalls = observer.step_stalls(0, 3)
    assert stalls["compiled_graphs"] == [0.0, 1.0, 0.0]
    assert stalls["gc_seconds"][2] > 0
    assert stalls["attention_tunings"] == [0.0, 0.0, 0.0]  # no attention kernel ran
    assert stalls["attention_compiles"] == [0.0, 0.0, 0.0]
    assert stalls["cuda_graph_recordings"] == [0.0, 0.0, 1.0]  # 1 for a step that recorded, however many inputs
    assert observer.step_stalls(1, 3)["compiled_graphs"] == [1.0, 0.0]
