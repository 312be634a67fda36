"""SequenceLogs.batch: tensor dtypes and shapes, jagged offsets, label masks, history cuts."""

import numpy as np
import pytest
import torch

from tests.event_log_builders import HAND_EVENTS, build, example_by_item, hand_events, history_items


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return build(hand_events(), tmp_path_factory.mktemp("loader") / "seq")[1]


@pytest.fixture(scope="module")
def batch(logs):
    return logs.batch(np.arange(len(logs)))


def test_batch_dtypes(batch):
    for name in ("example_index", "timestamp", "user_id", "item_id", "surface", "history_offsets", "history_item_id",
                 "history_surface", "history_event_type", "history_action"):
        assert getattr(batch, name).dtype == torch.int64, name
    assert batch.sparse_features["user_segment"].dtype == torch.int64
    for name in ("dense_features", "labels", "history_age_seconds"):
        assert getattr(batch, name).dtype == torch.float32, name
    assert batch.label_mask.dtype == torch.bool


def test_batch_shapes(logs, batch):
    n, tokens = len(logs), int(logs.history_lengths().sum())
    assert n == 9 and batch.size == n
    assert batch.dense_features.shape == (n, 1)
    assert batch.labels.shape == batch.label_mask.shape == (n, 2)
    assert batch.history_offsets.shape == (n + 1,)
    for name in ("history_item_id", "history_surface", "history_event_type", "history_action",
                 "history_age_seconds"):
        assert getattr(batch, name).shape == (tokens,), name


def test_offsets_agree_with_history_lengths(logs, batch):
    assert batch.history_offsets[0] == 0
    assert batch.history_lengths.tolist() == logs.history_lengths().tolist()
    assert int(batch.history_offsets[-1]) == batch.history_item_id.numel()


def test_features_follow_their_example(logs, batch):
    row = example_by_item(logs, 17)
    assert batch.sparse_features["user_segment"][row] == 7 % 5
    assert batch.dense_features[row, 0] == pytest.approx(1.7)
    assert logs.surfaces[int(batch.surface[row])] == "feed"


def test_user_id_follows_its_example(logs, batch):
    owner = {item: user for user, _, _, item, *_ in HAND_EVENTS}
    for item in (12, 17, 21, 34):
        assert batch.user_id[example_by_item(logs, item)] == owner[item]


def test_null_label_is_zero_and_masked(logs, batch):
    row = example_by_item(logs, 13)  # clicked 0, conversion unknown
    assert batch.labels[row].tolist() == [0.0, 0.0]
    assert batch.label_mask[row].tolist() == [True, False]
    row = example_by_item(logs, 14)  # clicked and converted
    assert batch.labels[row].tolist() == [1.0, 1.0]
    assert batch.label_mask[row].tolist() == [True, True]


def test_history_action_is_the_label_bitmask(logs):
    history = logs.batch([example_by_item(logs, 16)])  # history 11, 12, 13, 14, 15
    assert history.history_action.tolist() == [0, 1, 0, 3, 0]


def test_first_event_of_a_user_has_empty_history(logs):
    one = logs.batch([example_by_item(logs, 21)])
    assert one.history_offsets.tolist() == [0, 0]
    assert one.history_item_id.numel() == 0
    assert one.history_age_seconds.numel() == 0


def test_index_out_of_range_raises(logs):
    with pytest.raises(IndexError):
        logs.batch([len(logs)])
    with pytest.raises(IndexError):
        logs.batch([-1])


def test_max_history_len_override_cuts_to_the_most_recent(logs):
    row = example_by_item(logs, 17)
    cut = logs.batch([row], max_history_len=3)
    assert cut.history_item_id.tolist() == [14, 15, 16]
    assert history_items(logs, 17, max_history_len=1) == [16]
    assert logs.batch([row]).history_lengths.tolist() == [6]  # the override does not stick


def test_candidate_depth_is_how_far_back_the_user_last_met_the_item_beyond_any_cap(tmp_path):
    views = [(9, 0, 10 * i, item, "feed", "organic_view", None, None) for i, item in enumerate([1, 2, 3, 1, 4, 5, 6])]
    ads = [(9, 1, 0, 1, "feed", "ad_impression", 1, 0), (9, 1, 10, 8, "feed", "ad_impression", 0, 0),
           (9, 1, 20, 6, "feed", "ad_impression", 0, 0)]
    logs = build(hand_events(views + ads), tmp_path / "seq", max_history_len=2)[1]
    rows = [example_by_item(logs, item) for item in (1, 8, 6)]
    # Item 1 last seen 4 events before its ad (beyond the 2 kept); 8 never; 6 two events back (the ads between).
    assert logs.candidate_depths(rows).tolist() == [4, 0, 3]
    assert logs.batch(rows[:1]).history_item_id.tolist() == [5, 6]  # the cap does not bound the lookup


def test_retrieved_events_put_the_candidate_s_older_matches_before_the_recent_ones(tmp_path):
    # Item 1 viewed at positions 0 and 3, item 6 at 6; ads of 1, 8 and 6 follow the seven views.
    views = [(9, 0, 10 * i, item, "feed", "organic_view", None, None) for i, item in enumerate([1, 2, 3, 1, 4, 5, 6])]
    ads = [(9, 1, 0, 1, "feed", "ad_impression", 1, 0), (9, 1, 10, 8, "feed", "ad_impression", 0, 0),
           (9, 1, 20, 6, "feed", "ad_impression", 0, 0)]
    logs = build(hand_events(views + ads), tmp_path / "seq", max_history_len=4)[1]
    rows = np.array([example_by_item(logs, item) for item in (1, 8, 6)])
    plain = logs.batch(rows, history_caps=np.array([2, 2, 2]))
    found = logs.batch(rows, history_caps=np.array([2, 2, 2]), retrieved_events=1)
    # Item 1's latest view beyond its 2 recent events comes first; 8 has none; 6's view lies beyond its 2 (1, 8).
    assert per_example(found) == [[1, 5, 6], [6, 1], [6, 1, 8]]
    assert per_example(plain) == [[5, 6], [6, 1], [1, 8]]
    both = logs.batch(rows[:1], history_caps=np.array([2]), retrieved_events=5)
    assert per_example(both) == [[1, 1, 5, 6]]  # oldest first, as a history runs
    ages = both.history_age_seconds.tolist()
    assert ages == sorted(ages, reverse=True)
    # The model's longest history bounds the whole: a retrieved event takes the oldest recent one's place.
    assert per_example(logs.batch(rows[:1], retrieved_events=5)) == [[1, 4, 5, 6]]
    assert per_example(logs.batch(rows[:1], max_history_len=1, retrieved_events=5)) == [[1]]
    with pytest.raises(ValueError, match="retrieved_events"):
        logs.retrieve_matches(rows, np.array([2, 2, 2]), -1)


def per_example(batch) -> list[list[int]]:
    offsets = batch.history_offsets.tolist()
    return [batch.history_item_id[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]
