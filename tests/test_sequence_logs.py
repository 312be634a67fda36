"""sequence_logs: timelines stored once, examples whose history is strictly earlier, splits, equivalences."""

from datetime import timedelta

import numpy as np
import polars as pl
import pytest

from gem_ops.data.loader import SequenceLogs
from gem_ops.data.quality import leakage_violations
from gem_ops.data.raw_event_logs import write_partition
from gem_ops.data.sequence_logs import EXAMPLES, SequenceLogsConfig
from gem_ops.data.synthetic import SyntheticConfig, generate_day
from tests.event_log_builders import (
    DAY0,
    HAND_EVENTS,
    HAND_HISTORY_ITEMS,
    build,
    example_by_item,
    hand_events,
    histories_by_key,
    history_items,
    write,
)

NO_LEAKS = {"leaked": 0, "missed": 0, "unsorted": 0}
DAY = 86_400


@pytest.fixture(scope="module")
def hand(tmp_path_factory):
    """The hand-built log, built with defaults (all event types, long histories, eval = last day)."""
    summary, logs = build(hand_events(), tmp_path_factory.mktemp("hand") / "seq")
    return summary, logs


@pytest.fixture(scope="module")
def synthetic_days(tmp_path_factory):
    """Four synthetic days, each written as a raw_event_logs partition."""
    config = SyntheticConfig(n_users=300, n_items=2_000, n_ads=200, n_advertisers=20)
    folder = tmp_path_factory.mktemp("raw")
    days = [generate_day(config, config.start_date + timedelta(days=i)) for i in range(4)]
    paths = [write_partition(d, folder / f"day{i}.parquet") for i, d in enumerate(days)]
    return pl.concat(days), paths


# --- exact histories on the hand-built log ---------------------------------------------------------


def test_histories_are_every_earlier_event_of_the_user_in_time_order(hand):
    _, logs = hand
    for item, expected in HAND_HISTORY_ITEMS.items():
        assert history_items(logs, item) == expected, f"candidate {item}"


def test_batch_offsets_lengths_and_ages(hand):
    _, logs = hand
    batch = logs.batch([example_by_item(logs, i) for i in (17, 21, 14)])
    assert batch.history_offsets.tolist() == [0, 6, 6, 8]
    assert batch.history_lengths.tolist() == [6, 0, 2]
    assert batch.history_item_id.tolist() == [11, 12, 13, 14, 15, 16, 11, 12]
    ages_17 = [2 * DAY + 20 - 100, 2 * DAY + 20 - 200, DAY - 30, DAY - 30, DAY - 30, 10]
    ages_14 = [DAY + 50 - 100, DAY + 50 - 200]
    assert batch.history_age_seconds.tolist() == ages_17 + ages_14


def test_events_at_the_same_instant_never_see_each_other(hand):
    _, logs = hand
    tied = [example_by_item(logs, 13), example_by_item(logs, 14)]
    assert logs.column("history_end")[tied].tolist() == [2, 2]
    for item in (13, 14):
        assert not {13, 14, 15} & set(history_items(logs, item))


def test_no_history_event_is_at_or_after_the_request(hand):
    _, logs = hand
    batch = logs.batch(np.arange(len(logs)))
    assert batch.history_lengths.sum() > 0
    assert bool((batch.history_age_seconds > 0).all())


def test_history_only_events_are_not_examples(hand):
    summary, logs = hand
    assert sorted(logs.column("item_id").tolist()) == sorted(HAND_HISTORY_ITEMS)
    assert summary.n_examples == len(HAND_HISTORY_ITEMS)
    assert summary.n_events == len(HAND_EVENTS)


def test_single_event_user_has_empty_history(hand):
    _, logs = hand
    assert logs.column("history_end")[example_by_item(logs, 21)] == 0
    assert history_items(logs, 21) == []


def test_truncation_keeps_the_most_recent_events(tmp_path):
    _, logs = build(hand_events(), tmp_path / "seq", max_history_len=2)
    assert history_items(logs, 17) == [15, 16]
    assert history_items(logs, 16) == [14, 15]
    assert history_items(logs, 12) == [11]
    row = example_by_item(logs, 17)
    assert (logs.column("history_end")[row], logs.history_lengths()[row]) == (6, 2)


def test_excluded_event_types_leave_timelines_but_stay_examples(tmp_path):
    summary, logs = build(hand_events(), tmp_path / "seq", history_event_types=("organic_view", "ad_impression"))
    assert 16 not in logs.timeline_column("item_id").tolist()
    assert summary.n_timeline_events == len(HAND_EVENTS) - 1
    assert history_items(logs, 17) == [11, 12, 13, 14, 15]
    assert history_items(logs, 16) == [11, 12, 13, 14, 15]  # the notification is still a request
    assert history_items(logs, 13) == [11, 12]
    assert leakage_violations(logs) == NO_LEAKS


@pytest.mark.parametrize(
    "eval_days, eval_items", [(0, set()), (1, {16, 17, 34}), (2, {13, 14, 16, 17, 21, 34})]
)
def test_split_takes_the_last_eval_days_utc_days(tmp_path, eval_days, eval_items):
    summary, logs = build(hand_events(), tmp_path / "seq", eval_days=eval_days)
    items = logs.column("item_id")
    assert set(items[logs.split_indices("eval")].tolist()) == eval_items
    assert set(items[logs.split_indices("train")].tolist()) == set(HAND_HISTORY_ITEMS) - eval_items
    assert summary.n_eval == len(eval_items)


def test_storage_grows_with_events_not_history_lengths(hand):
    summary, logs = hand
    assert summary.n_timeline_events == len(HAND_EVENTS) == logs.timeline_column("item_id").size
    assert logs.history_lengths().sum() > summary.n_timeline_events  # histories overlap, stored once
    examples = pl.read_parquet(logs.path / EXAMPLES / "*.parquet")
    assert not any(isinstance(dtype, (pl.List, pl.Array)) for dtype in examples.schema.values())


# --- leakage check -------------------------------------------------------------------------------


def test_leakage_is_zero_on_built_logs(hand):
    assert leakage_violations(hand[1]) == NO_LEAKS


def test_leakage_check_detects_a_planted_leak(tmp_path):
    _, logs = build(hand_events(), tmp_path / "seq")
    (part,) = (logs.path / EXAMPLES).glob("*.parquet")
    examples = pl.read_parquet(part)
    leak = pl.col("item_id") == 33  # history [31, 32]; one more reaches 33 itself
    examples.with_columns(
        pl.when(leak).then(pl.col("history_end") + 1).otherwise("history_end").alias("history_end")
    ).write_parquet(part)
    assert leakage_violations(SequenceLogs(logs.path))["leaked"] == 1


# --- equivalent inputs give identical examples ------------------------------------------------------


def test_unsorted_input_gives_the_same_histories(tmp_path):
    by_time = hand_events().sort("timestamp", maintain_order=True)  # users interleaved
    _, logs = build(by_time, tmp_path / "seq")
    for item, expected in HAND_HISTORY_ITEMS.items():
        assert history_items(logs, item) == expected, f"candidate {item}"


def test_shuffled_input_gives_the_same_history_sets(tmp_path):
    _, logs = build(hand_events().sample(fraction=1.0, shuffle=True, seed=3), tmp_path / "seq")
    assert leakage_violations(logs) == NO_LEAKS
    for item, expected in HAND_HISTORY_ITEMS.items():
        assert sorted(history_items(logs, item)) == expected, f"candidate {item}"


def test_overlapping_sorted_files_give_the_same_histories(tmp_path):
    """Two user-time-sorted files whose days overlap: user 7's day-1 events sit in the second file."""
    events = hand_events()
    day = (pl.col("timestamp").dt.date() - pl.lit(DAY0)).dt.total_days()
    first = ((pl.col("user_id") == 7) & (day != 1)) | ((pl.col("user_id") == 1000) & (day == 0))
    a = write_partition(events.filter(first), tmp_path / "a.parquet")
    b = write_partition(events.filter(~first), tmp_path / "b.parquet")
    _, logs = build([a, b], tmp_path / "seq")
    assert leakage_violations(logs) == NO_LEAKS
    for item, expected in HAND_HISTORY_ITEMS.items():
        assert history_items(logs, item) == expected, f"candidate {item}"


def test_sorted_files_that_touch_in_time_keep_ties_apart(tmp_path):
    """The last event of one declared-sorted file and the first of the next share an instant: neither
    may see the other, so the files cannot simply be merged as disjoint runs."""
    rows = [(5, 0, 100, 1, "feed", "ad_impression", 0, 0), (5, 0, 200, 2, "feed", "ad_impression", 1, 0),
            (5, 0, 200, 3, "reels", "ad_impression", 0, 1), (5, 0, 300, 4, "feed", "ad_impression", 1, 1)]
    events = hand_events(rows)
    a = write_partition(events.filter(pl.col("item_id") <= 2), tmp_path / "a.parquet")
    b = write_partition(events.filter(pl.col("item_id") > 2), tmp_path / "b.parquet")
    _, logs = build([a, b], tmp_path / "seq")
    assert [history_items(logs, item) for item in (1, 2, 3, 4)] == [[], [1], [1], [1, 2, 3]]
    assert leakage_violations(logs) == NO_LEAKS


def test_daily_files_equal_one_file(tmp_path, synthetic_days):
    events, daily = synthetic_days
    _, from_days = build(daily, tmp_path / "days")
    _, from_one = build(events, tmp_path / "one")  # one time-sorted file: the global-sort path
    assert len(from_days) == len(from_one) > 0
    assert histories_by_key(from_days) == histories_by_key(from_one)


@pytest.mark.parametrize(
    "declared, split_by, path_taken",
    [
        # read whole, then cut into user ranges in memory
        (True, "chunk_events", lambda summary: summary.n_user_ranges >= 4),
        # past max_events_in_memory, files that declare their order stream one range of users at a time
        (True, "max_events_in_memory", lambda summary: summary.n_buckets == 1 and summary.n_user_ranges >= 4),
        # files that do not declare their order are read in hash buckets of users
        (False, "max_events_in_memory", lambda summary: summary.n_buckets >= 4),
    ],
    ids=["ranges-in-memory", "streamed-ranges", "hash-buckets"],
)
def test_split_builds_give_the_same_examples(tmp_path, synthetic_days, declared, split_by, path_taken):
    events, daily = synthetic_days
    if not declared:  # rewritten without the sort-order metadata that write_partition adds
        daily = [write(pl.read_parquet(p), tmp_path / f"plain-{i}.parquet") for i, p in enumerate(daily)]
    whole, in_memory = build(synthetic_days[1], tmp_path / "whole")
    split, in_parts = build(daily, tmp_path / "split", **{split_by: events.height // 4})
    assert whole.n_user_ranges == 1 and whole.n_buckets == 1
    assert path_taken(split)
    assert leakage_violations(in_parts) == NO_LEAKS
    assert split.n_timeline_events == whole.n_timeline_events == events.height
    assert histories_by_key(in_parts) == histories_by_key(in_memory)


def test_synthetic_days_build_without_leakage(tmp_path):
    config = SyntheticConfig(n_users=500)
    folder = tmp_path / "raw"
    days = [generate_day(config, config.start_date + timedelta(days=i)) for i in range(5)]
    paths = [write_partition(d, folder / f"day{i}.parquet") for i, d in enumerate(days)]
    summary, logs = build(paths, tmp_path / "seq", max_history_len=64)
    events = pl.concat(days)
    assert summary.n_examples == events.filter(pl.col("label_click").is_not_null()).height
    assert summary.n_timeline_events == events.height
    assert 0 < summary.n_eval < summary.n_examples
    assert logs.history_lengths().max() == 64
    assert leakage_violations(logs) == NO_LEAKS


# --- bad configuration ---------------------------------------------------------------------------


def test_max_history_len_zero_is_rejected():
    with pytest.raises(ValueError, match="max_history_len"):
        SequenceLogsConfig(max_history_len=0)


def test_history_event_types_matching_nothing_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="history_event_types"):
        build(hand_events(), tmp_path / "seq", history_event_types=("no_such_type",))
    assert not (tmp_path / "seq").exists()


def test_every_builder_setting_is_a_sequence_logs_run_config_field():
    import dataclasses

    from assets.sequence_logs import SequenceLogsAssetConfig

    assert {f.name for f in dataclasses.fields(SequenceLogsConfig)} - set(SequenceLogsAssetConfig.model_fields) == set()
    assert SequenceLogsAssetConfig().builder_config() == SequenceLogsConfig()
    config = SequenceLogsAssetConfig(max_history_len=64, eval_days=2, history_event_types=["click"],
                                     max_events_in_memory=10, chunk_events=5)
    assert config.builder_config() == SequenceLogsConfig(
        max_history_len=64, eval_days=2, history_event_types=("click",), max_events_in_memory=10, chunk_events=5)
    with pytest.raises(ValueError, match="chunk_events"):
        SequenceLogsAssetConfig(chunk_events=0).builder_config()
