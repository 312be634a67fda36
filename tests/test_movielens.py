import shutil
from datetime import date, datetime, timedelta, timezone

import polars as pl
import pytest

from gem_ops.data.event_logs import normalize_event_log
from gem_ops.data.movielens import (
    DEFAULT_MOVIELENS_DIR,
    MOVIELENS_HISTORY_EVENT_TYPES,
    load_movielens,
)

REPLAY_START = date(2026, 11, 1)
REPLAY_DAYS = 28

# The genre groups, written out independently of the adapter.
EXPECTED_SURFACE = {
    **dict.fromkeys(["Action", "Adventure", "Sci-Fi", "Thriller", "War", "Western"], "action"),
    **dict.fromkeys(["Comedy", "Romance", "Musical", "Children", "Animation", "Fantasy"], "comedy"),
    **dict.fromkeys(["Drama", "Crime", "Mystery", "Film-Noir", "Horror", "Documentary", "IMAX"], "drama"),
}


@pytest.fixture(scope="module")
def ratings() -> pl.DataFrame:
    return pl.read_csv(DEFAULT_MOVIELENS_DIR / "ratings.csv")


@pytest.fixture(scope="module")
def movies() -> pl.DataFrame:
    return pl.read_csv(DEFAULT_MOVIELENS_DIR / "movies.csv")


@pytest.fixture(scope="module")
def events() -> pl.DataFrame:
    return load_movielens()


def rating_events(events: pl.DataFrame) -> pl.DataFrame:
    return events.filter(pl.col("event_type") == "rating")


def test_bundled_sample_is_complete():
    names = {p.name for p in DEFAULT_MOVIELENS_DIR.iterdir()}
    assert names == {"README.txt", "links.csv", "movies.csv", "ratings.csv", "tags.csv"}


def test_event_counts(events: pl.DataFrame, ratings: pl.DataFrame):
    counts = dict(events.group_by("event_type").len().iter_rows())
    assert counts == {"rating": ratings.height, "sampled_negative": ratings.height}
    assert ratings.height == 100_004  # the bundled (2016) ml-latest-small
    assert load_movielens(negatives_per_rating=3).height == 4 * ratings.height
    assert load_movielens(negatives_per_rating=0).height == ratings.height
    assert MOVIELENS_HISTORY_EVENT_TYPES == ("rating",)


def test_output_is_canonical_and_sorted(events: pl.DataFrame):
    assert events.columns == [
        "user_id", "timestamp", "item_id", "surface", "event_type",
        "label_click", "label_conversion", "item_genre", "item_year",
    ]
    assert normalize_event_log(events, "movielens").equals(events)
    assert events["timestamp"].is_sorted()
    assert events["item_year"].null_count() == 0


def test_labels(events: pl.DataFrame, ratings: pl.DataFrame):
    rated = rating_events(events)
    assert (rated["label_click"] == 1).all()
    assert rated["label_conversion"].mean() == pytest.approx((ratings["rating"] >= 4).mean(), abs=1e-12)
    negatives = events.filter(pl.col("event_type") == "sampled_negative")
    assert (negatives["label_click"] == 0).all() and (negatives["label_conversion"] == 0).all()


def test_negatives_were_never_rated_by_their_user(events: pl.DataFrame, ratings: pl.DataFrame):
    negatives = events.filter(pl.col("event_type") == "sampled_negative")
    rated_pairs = ratings.select(user_id="userId", item_id="movieId")
    assert negatives.join(rated_pairs, on=["user_id", "item_id"], how="semi").is_empty()
    # Each negative shares its rating's timestamp.
    assert negatives.join(rating_events(events), on=["user_id", "timestamp"], how="anti").is_empty()


def test_sampling_is_seeded():
    assert load_movielens(seed=3).equals(load_movielens(seed=3))
    assert not load_movielens(seed=3).equals(load_movielens(seed=4))


def test_timestamps_are_a_linear_replay(events: pl.DataFrame, ratings: pl.DataFrame):
    start = datetime.combine(REPLAY_START, datetime.min.time(), tzinfo=timezone.utc)
    end = start + timedelta(days=REPLAY_DAYS)
    assert events["timestamp"].min() == start
    assert start <= events["timestamp"].max() < end

    replayed = rating_events(events).join(
        ratings.select(user_id="userId", item_id="movieId", original="timestamp"), on=["user_id", "item_id"]
    )
    assert replayed.height == ratings.height
    replayed = replayed.sort("original", "timestamp")
    assert replayed["timestamp"].is_sorted()  # order preserved

    first, last = ratings["timestamp"].min(), ratings["timestamp"].max()
    fraction = (replayed["original"] - first) / (last - first)
    offset_ms = (replayed["timestamp"] - start).dt.total_milliseconds()
    window_ms = REPLAY_DAYS * 86_400_000
    assert (offset_ms - fraction * window_ms).abs().max() <= 2  # linear, up to rounding


def test_replay_window_is_configurable():
    events = load_movielens(negatives_per_rating=0, replay_start=date(2027, 1, 10), replay_days=7)
    days = events["timestamp"].dt.date()
    assert days.min() == date(2027, 1, 10) and days.max() == date(2027, 1, 16)


def test_surfaces_and_item_features_follow_the_movie(events: pl.DataFrame, movies: pl.DataFrame):
    first_genre = movies.select(
        item_id="movieId", title="title", first_genre=pl.col("genres").str.split("|").list.first()
    )
    joined = events.join(first_genre, on="item_id")
    assert joined.height == events.height
    expected = joined["first_genre"].replace_strict(EXPECTED_SURFACE, default="other")
    assert (joined["surface"] == expected).all()
    assert set(events["surface"].unique()) == {"action", "comedy", "drama", "other"}
    # One genre id per first genre.
    assert joined.group_by("first_genre").agg(pl.col("item_genre").n_unique())["item_genre"].max() == 1
    assert joined.select("first_genre", "item_genre").unique()["item_genre"].n_unique() == (
        joined["first_genre"].n_unique()
    )

    toy_story = joined.filter(pl.col("item_id") == 1).row(0, named=True)
    assert toy_story["surface"] == "action" and toy_story["item_year"] == 1995.0
    fawlty_towers = joined.filter(pl.col("item_id") == 108583)
    assert fawlty_towers.is_empty() or fawlty_towers["item_year"][0] == 1975.0


def test_titles_without_year_get_the_median_year(tmp_path):
    (tmp_path / "movies.csv").write_text(
        "movieId,title,genres\n1,A (1990),Drama\n2,B (2000),Comedy\n3,C (2010),War\n4,No Year,(no genres listed)\n"
    )
    (tmp_path / "ratings.csv").write_text("userId,movieId,rating,timestamp\n1,4,4.5,100\n1,1,2.0,200\n")
    events = load_movielens(tmp_path, negatives_per_rating=0)
    years = dict(events.select("item_id", "item_year").iter_rows())
    assert years == {4: 2000.0, 1: 1990.0}
    assert events["surface"].to_list() == ["other", "drama"]
    assert events["label_conversion"].to_list() == [1, 0]


def test_missing_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="ratings.csv"):
        load_movielens(tmp_path / "nowhere")
    shutil.copy(DEFAULT_MOVIELENS_DIR / "ratings.csv", tmp_path / "ratings.csv")
    with pytest.raises(FileNotFoundError, match="movies.csv"):
        load_movielens(tmp_path)
