import dataclasses
from datetime import date, timedelta

import numpy as np
import polars as pl
import pytest

from gem_ops.data.event_logs import normalize_event_log
from gem_ops.data.synthetic import (
    AD_IMPRESSION,
    DEFAULT_SURFACES,
    ORGANIC_VIEW,
    SyntheticConfig,
    current_interest,
    generate_day,
    generate_days,
)
from tests.event_log_builders import CANONICAL_DTYPES

SMALL = SyntheticConfig(n_users=2_000)
# Large enough for the heavy tail (~0.5% power users) and for label rates to be measurable.
FORTNIGHT = SyntheticConfig(n_users=10_000)
FORTNIGHT_DAYS = 14



def day(config: SyntheticConfig, offset: int) -> date:
    return config.start_date + timedelta(days=offset)


@pytest.fixture(scope="module")
def fortnight() -> pl.DataFrame:
    events = generate_days(FORTNIGHT, FORTNIGHT.start_date, FORTNIGHT_DAYS)
    return events.with_columns(day_index=(pl.col("timestamp").dt.date() - FORTNIGHT.start_date).dt.total_days())


@pytest.fixture(scope="module")
def ads(fortnight: pl.DataFrame) -> pl.DataFrame:
    return fortnight.filter(pl.col("event_type") == AD_IMPRESSION)


def test_same_day_gives_identical_frame():
    first = generate_day(SMALL, day(SMALL, 3))
    assert first.equals(generate_day(SyntheticConfig(n_users=2_000), day(SMALL, 3)))
    # A day does not depend on which other days are generated with it.
    several = generate_days(SMALL, day(SMALL, 1), 4)
    assert several.filter(pl.col("timestamp").dt.date() == day(SMALL, 3)).equals(first)


def test_different_seed_gives_different_frame():
    assert not generate_day(SMALL, SMALL.start_date).equals(
        generate_day(SyntheticConfig(n_users=2_000, seed=1), SMALL.start_date)
    )


def test_output_is_canonical_and_sorted():
    events = generate_days(SMALL, SMALL.start_date, 3)
    assert dict(events.schema) == CANONICAL_DTYPES
    assert normalize_event_log(events, "synthetic").equals(events)
    assert events["timestamp"].is_sorted()
    assert set(events["event_type"].unique()) == {ORGANIC_VIEW, AD_IMPRESSION}
    assert events["timestamp"].dt.date().unique().sort().to_list() == [day(SMALL, i) for i in range(3)]


def test_days_before_start_date_raise():
    with pytest.raises(ValueError, match="day 2026-10-31"):
        generate_day(SMALL, date(2026, 10, 31))
    with pytest.raises(ValueError, match="day 2026-10-30"):
        generate_days(SMALL, date(2026, 10, 30), 5)


def test_item_id_ranges(fortnight: pl.DataFrame):
    organic_items = fortnight.filter(pl.col("item_id") < FORTNIGHT.ad_id_start)
    ad_items = fortnight.filter(pl.col("item_id") >= FORTNIGHT.ad_id_start)
    assert (organic_items["event_type"] == ORGANIC_VIEW).all()
    assert (organic_items["item_advertiser"] == 0).all() and (organic_items["item_bid"] == 0).all()
    assert (ad_items["item_advertiser"] >= 1).all() and (ad_items["item_bid"] > 0).all()
    assert ad_items["item_id"].max() < FORTNIGHT.ad_id_start + FORTNIGHT.n_ads


def test_label_nulls_and_conversion_within_click(fortnight: pl.DataFrame, ads: pl.DataFrame):
    organic = fortnight.filter(pl.col("event_type") == ORGANIC_VIEW)
    assert organic["label_click"].null_count() == organic.height
    assert organic["label_conversion"].null_count() == organic.height
    assert ads["label_click"].null_count() == 0
    stories = ads.filter(pl.col("surface") == "stories")
    assert stories.height > 0 and stories["label_conversion"].null_count() == stories.height
    assert ads.filter(pl.col("surface") != "stories")["label_conversion"].null_count() == 0
    assert ads.filter((pl.col("label_conversion") == 1) & (pl.col("label_click") == 0)).height == 0
    assert ads["label_conversion"].sum() > 0


def test_label_probabilities_are_what_the_labels_were_drawn_with():
    """The Bayes-optimal scores: the same events with or without them, null exactly where the labels are, and
    the labels' rates within a few standard errors of the probabilities' means."""
    days = [generate_day(FORTNIGHT, day(FORTNIGHT, i), label_probabilities=True) for i in range(3)]
    events = pl.concat(days)
    assert days[1].drop("p_click", "p_conversion").equals(generate_day(FORTNIGHT, day(FORTNIGHT, 1)))
    for label, probability in (("label_click", "p_click"), ("label_conversion", "p_conversion")):
        assert (events[label].is_null() == events[probability].is_null()).all()
        known = events.filter(pl.col(label).is_not_null())
        p, y = known[probability].to_numpy(), known[label].to_numpy()
        assert ((p > 0) & (p <= 0.95)).all()
        assert abs(y.sum() - p.sum()) < 4 * np.sqrt((p * (1 - p)).sum()), (label, y.sum(), p.sum())
    converting = events.filter(pl.col("p_conversion").is_not_null())
    assert (converting["p_conversion"] <= converting["p_click"]).all()
    # The probabilities rank the labels far better than chance: they are the planted signal itself.
    clicks = events.filter(pl.col("label_click").is_not_null())
    hit = clicks.filter(pl.col("label_click") == 1)["p_click"].mean()
    assert hit > 1.5 * clicks.filter(pl.col("label_click") == 0)["p_click"].mean()


def test_surfaces_have_their_base_rates(ads: pl.DataFrame):
    rates = dict(ads.group_by("surface").agg(pl.col("label_click").mean()).iter_rows())
    for spec in DEFAULT_SURFACES:
        assert 0.6 * spec.ctr < rates[spec.name] < 1.6 * spec.ctr, (spec.name, rates[spec.name])
    assert rates["search"] > 1.3 * rates["feed"] > 1.3 * 1.3 * rates["reels"] > 1.3**3 * rates["stories"]

    clicked = ads.filter(pl.col("label_click") == 1)
    conversion_rates = dict(clicked.group_by("surface").agg(pl.col("label_conversion").mean()).iter_rows())
    for spec in DEFAULT_SURFACES:
        if spec.cvr is not None:
            assert 0.5 * spec.cvr < conversion_rates[spec.name] < 2 * spec.cvr, (spec.name, conversion_rates[spec.name])


def test_history_lengths_are_heavy_tailed(fortnight: pl.DataFrame):
    per_user = fortnight.group_by("user_id").len()["len"]
    power_share = (per_user > 1000).mean()
    assert per_user.median() < 50
    assert 0.001 < power_share < 0.02
    assert per_user.max() <= FORTNIGHT_DAYS * FORTNIGHT.max_events_per_user_per_day + FORTNIGHT.early_items_per_user


def with_current_interest(events: pl.DataFrame) -> pl.DataFrame:
    interests = pl.concat(
        pl.DataFrame(
            {
                "day_index": offset,
                "user_id": np.arange(FORTNIGHT.n_users),
                "interest": current_interest(FORTNIGHT, day(FORTNIGHT, offset)),
            }
        )
        for offset in range(FORTNIGHT_DAYS)
    )
    return events.join(interests, on=["day_index", "user_id"])


def test_interest_drives_views_and_clicks(fortnight: pl.DataFrame, ads: pl.DataFrame):
    content_views = with_current_interest(
        fortnight.filter((pl.col("event_type") == ORGANIC_VIEW) & (pl.col("item_id") < FORTNIGHT.ad_id_start))
    )
    assert (content_views["item_category"] == content_views["interest"]).mean() > 0.7

    ctr = dict(
        with_current_interest(ads)
        .group_by(matches=pl.col("item_category") == pl.col("interest"))
        .agg(pl.col("label_click").mean())
        .iter_rows()
    )
    assert ctr[True] > 1.5 * ctr[False]


def test_retargeting_early_items_converts_more(fortnight: pl.DataFrame, ads: pl.DataFrame):
    # Retargeting impressions: the ad was among the user's organic views of the early days.
    early_views = (
        fortnight.filter(
            (pl.col("event_type") == ORGANIC_VIEW)
            & (pl.col("item_id") >= FORTNIGHT.ad_id_start)
            & (pl.col("day_index") < FORTNIGHT.early_days)
        )
        .select("user_id", "item_id")
        .unique()
    )
    assert early_views.height > 0.9 * FORTNIGHT.n_users
    assert fortnight.filter(
        (pl.col("event_type") == ORGANIC_VIEW)
        & (pl.col("item_id") >= FORTNIGHT.ad_id_start)
        & (pl.col("day_index") >= FORTNIGHT.early_days)
    ).is_empty()

    later = ads.filter(pl.col("day_index") >= FORTNIGHT.early_days).join(
        early_views.with_columns(retarget=pl.lit(True)), on=["user_id", "item_id"], how="left"
    )
    rates = {
        retarget: (share, conversion)
        for retarget, share, conversion in later.group_by(retarget=pl.col("retarget").fill_null(False))
        .agg(pl.len() / later.height, pl.col("label_conversion").mean())
        .iter_rows()
    }
    assert 0.10 < rates[True][0] < 0.20  # close to the configured retarget share
    assert rates[True][1] >= 3 * rates[False][1]


def test_recurring_retargeting_shows_each_early_item_at_most_once_and_only_every_other_day():
    from gem_ops.data.synthetic import RECURRING_SIGNAL, _users

    config = dataclasses.replace(RECURRING_SIGNAL, n_users=1_500)
    events = generate_days(config, config.start_date, 9).with_columns(
        day_index=(pl.col("timestamp").dt.date() - config.start_date).dt.total_days())
    users = _users(config)
    early = pl.DataFrame({"user_id": np.repeat(np.arange(config.n_users), config.early_items_per_user),
                          "item_id": users.early_items.ravel(), "early": True}).unique(["user_id", "item_id"])
    ads = events.filter(pl.col("event_type") == AD_IMPRESSION).join(early, on=["user_id", "item_id"], how="left") \
        .with_columns(pl.col("early").fill_null(False))
    per_day = {d: share for d, share in ads.group_by("day_index").agg(pl.col("early").mean()).iter_rows()}
    retargeting_days = {3, 5, 7}  # every other day after the 2 early days
    for d, share in per_day.items():
        if d in retargeting_days:
            assert share > 0.1, (d, share)
        else:  # only an ad drawn at random that happens to be an early item
            assert share < 0.01, (d, share)
    def repeated(frame: pl.DataFrame) -> float:
        counts = frame.filter(pl.col("early")).group_by("user_id", "item_id", "day_index").len()
        return float((counts["len"] > 1).mean())

    # Once per (user, early item, day), bar the random draw of a popular early item as a plain ad; retargeting
    # every day shows power users their early items over and over
    daily = dataclasses.replace(config, retarget_every_days=1)
    daily_ads = generate_days(daily, daily.start_date, 9).with_columns(
        day_index=(pl.col("timestamp").dt.date() - daily.start_date).dt.total_days()
    ).filter(pl.col("event_type") == AD_IMPRESSION).join(early, on=["user_id", "item_id"], how="left") \
        .with_columns(pl.col("early").fill_null(False))
    assert repeated(ads) < 0.03 and repeated(daily_ads) > 0.1
    burst = ads.filter(pl.col("day_index").is_in(list(retargeting_days)))
    ctr = dict(burst.group_by("early").agg(pl.col("label_click").mean()).iter_rows())
    assert ctr[True] > 1.5 * ctr[False]


def test_recurring_retargeting_needs_a_positive_period():
    with pytest.raises(ValueError, match="retarget_every_days"):
        SyntheticConfig(retarget_every_days=0)


def test_ad_quality_drift_moves_the_ranking_among_ads_from_day_to_day():
    """ad_quality_drift > 0: day 0 keeps the catalog's qualities, later days walk away from them (the farther,
    the less alike), each day extends the one before, the mean stays 1; 0 leaves every day's frame unchanged."""
    from gem_ops.data.synthetic import _STREAM_QUALITY, _ad_quality, _catalog, _quality_walk

    drifting = dataclasses.replace(SMALL, ad_quality_drift=0.3)
    catalog = _catalog(drifting)
    base = np.log(catalog.click_quality)
    assert np.array_equal(_ad_quality(drifting, catalog, 0)[0], catalog.click_quality)
    alike = [np.corrcoef(base, np.log(_ad_quality(drifting, catalog, d)[0]))[0, 1] for d in (1, 5, 20)]
    assert alike[0] > alike[1] > alike[2] and alike[2] < 0.8
    for quality in _ad_quality(drifting, catalog, 5):
        assert quality.mean() == pytest.approx(1.0)
    _quality_walk.cache_clear()  # a fresh stream: day 6 is day 5 plus one step, whichever is drawn first
    six, five = (_quality_walk(drifting, d, _STREAM_QUALITY, 0.3, drifting.n_ads) for d in (6, 5))
    assert np.std(six - five) == pytest.approx(0.3, rel=0.1)
    assert generate_day(SMALL, day(SMALL, 3)).equals(generate_day(dataclasses.replace(SMALL, ad_quality_drift=0.0),
                                                                  day(SMALL, 3)))
    assert not generate_day(drifting, day(SMALL, 3)).equals(generate_day(SMALL, day(SMALL, 3)))
    with pytest.raises(ValueError, match="ad_quality_drift"):
        dataclasses.replace(SMALL, ad_quality_drift=-0.1)


def test_category_quality_drift_moves_every_ad_of_a_category_together():
    """category_quality_drift > 0: on a later day an ad's quality over the catalog's is its category's shift,
    the same for every ad of the category and different between categories; the mean stays 1."""
    from gem_ops.data.synthetic import _ad_quality, _catalog

    drifting = dataclasses.replace(SMALL, category_quality_drift=0.3)
    catalog = _catalog(drifting)
    category = catalog.category[drifting.ad_id_start:]
    assert np.array_equal(_ad_quality(drifting, catalog, 0)[0], catalog.click_quality)
    for quality, base in zip(_ad_quality(drifting, catalog, 5), (catalog.click_quality, catalog.conversion_quality)):
        assert quality.mean() == pytest.approx(1.0)
        shift = np.log(quality / base)
        per_category = [shift[category == c] for c in range(drifting.n_categories)]
        assert max(np.ptp(s) for s in per_category) < 1e-9  # one shift per category
        assert np.std([s[0] for s in per_category]) > 0.3  # five steps of 0.3 apart
    assert not generate_day(drifting, day(SMALL, 3)).equals(generate_day(SMALL, day(SMALL, 3)))
    with pytest.raises(ValueError, match="category_quality_drift"):
        dataclasses.replace(SMALL, category_quality_drift=-0.1)
