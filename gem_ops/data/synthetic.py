"""Synthetic ads logs: the pipeline's embedded default event source, at any scale.

Each call to `generate_day` produces one day of events for a fixed population of users, in the
canonical event-log schema (see gem_ops.data.schema), sorted by timestamp:

    user_id, timestamp, item_id, surface, event_type, label_click, label_conversion,
    user_segment, user_age_bucket, item_category, item_advertiser, item_bid

Event types
    organic_view    content the user looked at; history only, so every label is null
    ad_impression   an ad shown to the user; label_click is 0/1, label_conversion is 0/1 on surfaces
                    that track conversions and null elsewhere (stories), and is 1 only after a click

Item ids
    organic content items are 0 .. n_items-1 (item_advertiser 0, item_bid 0.0); ads follow them,
    n_items .. n_items+n_ads-1 (`SyntheticConfig.ad_id_start`), with advertisers 1..n_advertisers.

Activity (heavy tail)
    A user's expected events per day is  events_per_user_per_day * exp(Z),  Z ~ Normal(-s^2/2, s)
    with s = activity_sigma (2.0): a lognormal with mean 1, so the population mean is the configured
    rate. The day's count is Poisson around it, capped at max_events_per_user_per_day. At the default
    rate (3/day) and s = 2, over 14 days the median user has fewer than 10 events (early views
    included) while ~0.5% of users have more than 1000 (24 times the mean) and make about a third
    of all events.

Planted signal (what a model can learn)
    - Current interest: every user has a primary category; for each block of interest_period_days
      the current interest is the primary one with probability interest_stickiness, otherwise a
      random category. Organic views fall in the current interest with probability
      organic_interest_share; ads are targeted at it with probability ad_targeting_share, and an ad
      whose category matches it is clicked interest_ctr_lift times as often.
    - user_segment x item_category and user_age_bucket x surface affinities and per-ad click and
      conversion quality, all multiplicative with mean 1. With ad_quality_drift > 0 each ad's quality
      walks (in log space, renormalised to mean 1) from day to day: which ads are good changes over time.
      With category_quality_drift > 0 every ad of a category walks together (a category's season): a
      shift that fresh days show for each category, where one ad's impressions are too few to show it.
    - Long range: during the first early_days days after start_date each user views a few ad items
      (their early items) as organic_view events. Afterwards a retarget_share of that user's ad
      impressions show those same items, and any impression of an early item is clicked
      retarget_ctr_lift times and converts (given a click) retarget_cvr_lift times as often. A
      model sees the candidate in the history only when the history reaches back to the first days,
      which for power users is thousands of events back.
    - Recurring (retarget_every_days > 1, "a purchase every September"): retargeting runs only on
      every retarget_every_days-th day after the early phase, and there it shows each user each early
      item once, in the first of the user's impressions that would retarget that day. Between those
      days the early items leave the recent history: a light user's last exposure stays a few events
      back, a power user's lies hundreds of events back, and only a long history reaches it.
    Click and conversion probabilities are normalised so that each surface's average rates stay
    close to its configured base rates.

Determinism
    The catalog and the users' latent state (activity, segment, age, interests, early items) depend
    only on the config; each day's draws come from a generator seeded by (seed, day ordinal), so the
    same (config, day) always yields the identical frame, whatever other days are generated.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from datetime import date, datetime

import numpy as np
import polars as pl
import pyarrow as pa

from gem_ops.data.schema import TIMESTAMP_DTYPE

ORGANIC_VIEW = "organic_view"
AD_IMPRESSION = "ad_impression"
EVENT_TYPES = (ORGANIC_VIEW, AD_IMPRESSION)

MS_PER_DAY = 86_400_000

# Independent random streams, so that e.g. adding a user-state draw never shifts the daily draws.
_STREAM_CATALOG = 1
_STREAM_USERS = 2
_STREAM_INTEREST = 3
_STREAM_DAY = 4
_STREAM_QUALITY = 5
_STREAM_CATEGORY_QUALITY = 6


@dataclass(frozen=True)
class SurfaceSpec:
    """One surface (domain) with its share of traffic and its base rates.

    ctr is the average click rate of ad impressions; cvr the average conversion rate given a click,
    or None when the surface does not track conversions (label_conversion is then null).
    """

    name: str
    traffic_share: float
    ctr: float
    cvr: float | None
    ctr_drift: float = 0.0  # relative change of ctr per day after start_date (a trend stale models miss)


DEFAULT_SURFACES = (
    SurfaceSpec("feed", traffic_share=0.45, ctr=0.03, cvr=0.10),
    SurfaceSpec("reels", traffic_share=0.25, ctr=0.015, cvr=0.05),
    SurfaceSpec("stories", traffic_share=0.15, ctr=0.008, cvr=None),
    SurfaceSpec("search", traffic_share=0.15, ctr=0.06, cvr=0.15),
)


@dataclass(frozen=True)
class SyntheticConfig:
    """Everything that shapes the synthetic logs; the same config always gives the same logs."""

    seed: int = 0
    # Population and activity.
    n_users: int = 20_000
    events_per_user_per_day: float = 3.0  # mean; per-user activity is lognormal (see module doc)
    activity_sigma: float = 2.0  # sigma of the log-activity; larger means a heavier tail
    max_events_per_user_per_day: int = 2_000  # caps the heaviest users
    n_segments: int = 8
    n_age_buckets: int = 6
    # Catalog.
    n_items: int = 50_000  # organic content items
    n_ads: int = 5_000
    n_categories: int = 32
    n_advertisers: int = 500
    popularity_exponent: float = 2.0  # >1 skews picks within a category towards a few popular items
    # Traffic.
    surfaces: tuple[SurfaceSpec, ...] = field(default=DEFAULT_SURFACES)
    ad_share: float = 0.4  # share of (non early-view) events that are ad impressions
    # Interests.
    organic_interest_share: float = 0.8  # organic views in the current-interest category
    ad_targeting_share: float = 0.3  # non-retargeting ads picked from the current-interest category
    interest_ctr_lift: float = 2.5  # CTR multiplier when the ad's category is the current interest
    interest_period_days: int = 7  # the current interest is redrawn every this many days
    interest_stickiness: float = 0.7  # chance that a period's interest is the user's primary one
    # Affinities and ad quality: sigmas of mean-1 lognormal multipliers.
    segment_category_sigma: float = 0.5
    age_surface_sigma: float = 0.3
    ad_quality_sigma: float = 0.4
    # Each ad's click and conversion quality walks in log space by this sd per day after start_date: the
    # ranking among ads changes, a trend a teacher trained on older days misses (0: fixed quality).
    ad_quality_drift: float = 0.0
    # The same walk per category, shared by its ads (0: none).
    category_quality_drift: float = 0.0
    # Long-range retargeting.
    early_days: int = 2  # days after start_date in which users view their early items
    early_items_per_user: int = 3  # ad items each user views (once each) in the early days
    retarget_share: float = 0.15  # share of later ad impressions that show an early item
    retarget_ctr_lift: float = 3.0  # CTR multiplier on impressions of an early item
    retarget_cvr_lift: float = 2.5  # conversion-given-click multiplier on those impressions
    retarget_every_days: int = 1  # >1: retargeting only every this many days, each early item once (module doc)
    start_date: date = date(2026, 11, 1)  # the first day of the logs; earlier days are rejected

    def __post_init__(self) -> None:
        positive = ("n_users", "n_segments", "n_age_buckets", "n_items", "n_ads", "n_categories",
                    "n_advertisers", "max_events_per_user_per_day", "interest_period_days", "retarget_every_days")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"SyntheticConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("n_items", "n_ads"):
            if getattr(self, name) < self.n_categories:
                raise ValueError(f"SyntheticConfig.{name} must be >= n_categories so every category has items")
        shares = ("ad_share", "organic_interest_share", "ad_targeting_share", "interest_stickiness",
                  "retarget_share")
        for name in shares:
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"SyntheticConfig.{name} must lie in [0, 1], got {getattr(self, name)}")
        if self.events_per_user_per_day < 0 or self.activity_sigma < 0:
            raise ValueError("SyntheticConfig: events_per_user_per_day and activity_sigma must be >= 0")
        for name in ("ad_quality_drift", "category_quality_drift"):
            if getattr(self, name) < 0:
                raise ValueError(f"SyntheticConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.early_days < 0 or self.early_items_per_user < 0:
            raise ValueError("SyntheticConfig: early_days and early_items_per_user must be >= 0")
        names = [s.name for s in self.surfaces]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"SyntheticConfig.surfaces must be non-empty with unique names, got {names}")
        if sum(s.traffic_share for s in self.surfaces) <= 0:
            raise ValueError("SyntheticConfig.surfaces: traffic shares must sum to more than 0")
        for spec in self.surfaces:
            rates = (spec.ctr,) if spec.cvr is None else (spec.ctr, spec.cvr)
            if spec.traffic_share < 0 or not all(0.0 <= r <= 1.0 for r in rates) or spec.ctr_drift <= -1.0:
                raise ValueError(f"SyntheticConfig.surfaces: bad shares, rates or drift in {spec}")

    @property
    def ad_id_start(self) -> int:
        """The first ad item id; organic content items lie below it."""
        return self.n_items


STRONG_SIGNAL = SyntheticConfig(
    n_users=3000, n_items=2000, n_ads=3000, n_advertisers=50, events_per_user_per_day=2.0, ad_share=0.6,
    surfaces=(SurfaceSpec("feed", 0.45, 0.12, 0.4), SurfaceSpec("reels", 0.25, 0.08, 0.35),
              SurfaceSpec("stories", 0.15, 0.06, None), SurfaceSpec("search", 0.15, 0.2, 0.4)),
    interest_ctr_lift=5.0, segment_category_sigma=1.0, ad_quality_sigma=0.8, age_surface_sigma=0.6,
    retarget_share=0.3, retarget_ctr_lift=6.0,
)
"""A small population with dense labels and strong planted effects (retargeting included), learnable in
about a minute on a CPU: for learning tests and quick demonstrations."""

RECURRING_SIGNAL = replace(STRONG_SIGNAL, retarget_every_days=2, early_items_per_user=10)
"""STRONG_SIGNAL with its retargeting recurring every other day (days 3, 5, 7, ... after start_date), each of
a user's 10 early items shown at most once per such day: the pattern that only power users' long histories
still hold."""


def generate_day(config: SyntheticConfig, day: date, label_probabilities: bool = False) -> pl.DataFrame:
    """One day's events for the whole population, in canonical dtypes, sorted by timestamp.

    With label_probabilities, two more columns hold the probabilities each ad impression's labels were drawn
    with (p_click, and p_conversion = P(click and conversion); null where the label is): the Bayes-optimal
    scores, for measuring how far a model is from the best possible. The events are the same either way."""
    day_index = _day_index(config, day)
    catalog = _catalog(config)
    users = _users(config)
    rng = np.random.default_rng([config.seed, _STREAM_DAY, day.toordinal()])
    interest = current_interest(config, day)

    counts = np.minimum(rng.poisson(users.rate), config.max_events_per_user_per_day)
    # The early phase adds each user's views of their early items on the days drawn for them.
    early_user, early_item = _early_views(config, users, day_index)
    user = np.concatenate([np.repeat(np.arange(config.n_users, dtype=np.int64), counts), early_user])
    item = np.concatenate([np.full(user.size - early_user.size, -1, dtype=np.int64), early_item])
    # A day's events are exchangeable, so shuffling them onto sorted times replaces sorting them later.
    order = rng.permutation(user.size)
    user, item = user[order], item[order]
    n = user.size
    day_start_ms = (day - date(1970, 1, 1)).days * MS_PER_DAY
    timestamp = day_start_ms + np.sort(rng.integers(0, MS_PER_DAY, n, dtype=np.int64))
    surface = _pick_surfaces(config, rng, n)
    is_early_view = item >= 0
    is_ad = ~is_early_view & (rng.random(n) < config.ad_share)

    organic = ~is_ad & ~is_early_view
    item[organic] = _organic_items(config, catalog, rng, interest[user[organic]])
    retargeting_active = _retargeting_day(config, day_index)
    ads = np.flatnonzero(is_ad)
    ad_user = user[ads]
    item[ads], retarget_share = _ad_items(config, catalog, users, rng, ad_user, interest[ad_user], retargeting_active)

    click = np.zeros(n, dtype=np.int8)
    conversion = np.zeros(n, dtype=np.int8)
    p_click = np.zeros(n)
    p_conversion = np.zeros(n)
    click[ads], conversion[ads], p_click[ads], p_conversion[ads] = _ad_labels(
        config, catalog, users, rng, ad_user, item[ads], surface[ads], interest[ad_user], retargeting_active,
        retarget_share, day_index,
    )
    tracks_conversion = np.array([s.cvr is not None for s in config.surfaces])
    conversion_known = is_ad & tracks_conversion[surface]

    surface_names = pl.Series([s.name for s in config.surfaces], dtype=pl.String)
    event_names = pl.Series(EVENT_TYPES, dtype=pl.String)
    probabilities = [pl.Series("p_click", p_click).set(pl.Series(~is_ad), None),
                     pl.Series("p_conversion", p_conversion).set(pl.Series(~conversion_known), None)]
    return pl.DataFrame(
        [
            pl.Series("user_id", user),
            pl.Series("timestamp", timestamp).cast(pl.Datetime("ms")).dt.replace_time_zone("UTC"),
            pl.Series("item_id", item),
            surface_names.gather(surface).alias("surface"),
            event_names.gather(is_ad.astype(np.uint32)).alias("event_type"),
            _nullable_int8("label_click", click, is_ad),
            _nullable_int8("label_conversion", conversion, conversion_known),
            pl.Series("user_segment", users.segment[user]),
            pl.Series("user_age_bucket", users.age_bucket[user]),
            pl.Series("item_category", catalog.category[item]),
            pl.Series("item_advertiser", catalog.advertiser[item]),
            pl.Series("item_bid", catalog.bid[item]),
            *(probabilities if label_probabilities else []),
        ]
    ).with_columns(pl.col("timestamp").cast(TIMESTAMP_DTYPE))


def generate_days(config: SyntheticConfig, start: date, days: int) -> pl.DataFrame:
    """Events of `days` consecutive days from `start`, sorted by timestamp."""
    if days < 1:
        raise ValueError(f"days must be >= 1, got {days}")
    _day_index(config, start)
    frames = [generate_day(config, date.fromordinal(start.toordinal() + i)) for i in range(days)]
    return pl.concat(frames, rechunk=False)  # days are disjoint and each sorted, so this stays sorted


def current_interest(config: SyntheticConfig, day: date) -> np.ndarray:
    """Each user's current-interest category on `day` (the ground truth behind the planted signal)."""
    period = _day_index(config, day) // config.interest_period_days
    rng = np.random.default_rng([config.seed, _STREAM_INTEREST, period])
    keep = rng.random(config.n_users) < config.interest_stickiness
    drifted = rng.integers(0, config.n_categories, config.n_users)
    return np.where(keep, _users(config).primary_interest, drifted)


def _retargeting_day(config: SyntheticConfig, day_index: int) -> bool:
    if not (0 < config.early_days <= day_index and config.early_items_per_user > 0):
        return False
    every = config.retarget_every_days
    return every == 1 or (day_index - config.early_days) % every == every - 1


def _day_index(config: SyntheticConfig, day: date) -> int:
    if isinstance(day, datetime) or not isinstance(day, date):
        raise TypeError(f"day must be a datetime.date, got {day!r}")
    index = (day - config.start_date).days
    if index < 0:
        raise ValueError(f"day {day} is before the synthetic logs' start_date {config.start_date}")
    return index


@dataclass(frozen=True)
class _Catalog:
    """Per-item lookup arrays indexed by item id, and the items of each category."""

    category: np.ndarray  # int64
    advertiser: np.ndarray  # int64, 0 for organic items
    bid: np.ndarray  # float32, 0 for organic items
    click_quality: np.ndarray  # float64 multiplier, ads only (indexed by item_id - ad_id_start)
    conversion_quality: np.ndarray
    organic_by_category: tuple[np.ndarray, np.ndarray]  # (item ids grouped by category, offsets)
    ads_by_category: tuple[np.ndarray, np.ndarray]


@dataclass(frozen=True)
class _Users:
    rate: np.ndarray  # expected events per day
    segment: np.ndarray
    age_bucket: np.ndarray
    primary_interest: np.ndarray
    early_items: np.ndarray  # (n_users, early_items_per_user) ad item ids
    early_day: np.ndarray  # (n_users, early_items_per_user) early-phase day index of each view
    segment_category: np.ndarray  # (n_segments, n_categories) click multiplier, mean 1
    age_surface: np.ndarray  # (n_age_buckets, n_surfaces) click multiplier, mean 1 per surface


@functools.lru_cache(maxsize=4)
def _catalog(config: SyntheticConfig) -> _Catalog:
    rng = np.random.default_rng([config.seed, _STREAM_CATALOG])
    # A shuffled round-robin gives every category items in both inventories.
    organic_category = rng.permutation(np.arange(config.n_items) % config.n_categories)
    ad_category = rng.permutation(np.arange(config.n_ads) % config.n_categories)
    ad_advertiser = rng.integers(1, config.n_advertisers + 1, config.n_ads)
    ad_bid = np.round(rng.lognormal(0.0, 0.6, config.n_ads), 2)
    return _Catalog(
        category=np.concatenate([organic_category, ad_category]).astype(np.int64),
        advertiser=np.concatenate([np.zeros(config.n_items, np.int64), ad_advertiser]),
        bid=np.concatenate([np.zeros(config.n_items), ad_bid]).astype(np.float32),
        click_quality=_mean_one(rng.lognormal(0.0, config.ad_quality_sigma, config.n_ads)),
        conversion_quality=_mean_one(rng.lognormal(0.0, config.ad_quality_sigma, config.n_ads)),
        organic_by_category=_group_by_category(organic_category, config.n_categories, 0),
        ads_by_category=_group_by_category(ad_category, config.n_categories, config.ad_id_start),
    )


@functools.lru_cache(maxsize=4)
def _users(config: SyntheticConfig) -> _Users:
    rng = np.random.default_rng([config.seed, _STREAM_USERS])
    n, k = config.n_users, config.early_items_per_user
    sigma = config.activity_sigma
    activity = rng.lognormal(-0.5 * sigma**2, sigma, n)  # mean 1
    early_days = max(config.early_days, 1)
    return _Users(
        rate=np.minimum(config.events_per_user_per_day * activity, config.max_events_per_user_per_day),
        segment=rng.integers(0, config.n_segments, n),
        age_bucket=rng.integers(0, config.n_age_buckets, n),
        primary_interest=rng.integers(0, config.n_categories, n),
        early_items=config.ad_id_start + rng.integers(0, config.n_ads, (n, k)),
        early_day=rng.integers(0, early_days, (n, k)),
        segment_category=_mean_one(
            rng.lognormal(0.0, config.segment_category_sigma, (config.n_segments, config.n_categories))
        ),
        age_surface=_mean_one(
            rng.lognormal(0.0, config.age_surface_sigma, (config.n_age_buckets, len(config.surfaces))), axis=0
        ),
    )


def _ad_quality(config: SyntheticConfig, catalog: _Catalog, day_index: int) -> tuple[np.ndarray, np.ndarray]:
    """Each ad's (click, conversion) quality on a day: the catalog's, moved by the random walks of
    ad_quality_drift (per ad) and category_quality_drift (per category), and brought back to mean 1 (the
    surfaces' rates stay as set)."""
    if (config.ad_quality_drift == 0 and config.category_quality_drift == 0) or day_index == 0:
        return catalog.click_quality, catalog.conversion_quality
    walk = np.zeros((2, config.n_ads))
    if config.ad_quality_drift > 0:
        walk = walk + _quality_walk(config, day_index, _STREAM_QUALITY, config.ad_quality_drift, config.n_ads)
    if config.category_quality_drift > 0:
        by_category = _quality_walk(config, day_index, _STREAM_CATEGORY_QUALITY, config.category_quality_drift,
                                    config.n_categories)
        walk = walk + by_category[:, catalog.category[config.ad_id_start:config.ad_id_start + config.n_ads]]
    return (_mean_one(catalog.click_quality * np.exp(walk[0])),
            _mean_one(catalog.conversion_quality * np.exp(walk[1])))


@functools.lru_cache(maxsize=32)
def _quality_walk(config: SyntheticConfig, day_index: int, stream: int, sd: float, n: int) -> np.ndarray:
    """[2, n] the walk's position on a day: the sum of its first day_index steps, drawn in order from one
    stream, so that every day extends the day before whatever days are generated."""
    rng = np.random.default_rng([config.seed, stream])
    return rng.normal(0.0, sd, (day_index, 2, n)).sum(0)


def _mean_one(values: np.ndarray, axis: int | None = None) -> np.ndarray:
    return values / values.mean(axis=axis, keepdims=axis is not None)


def _group_by_category(category: np.ndarray, n_categories: int, id_start: int) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(category, kind="stable")
    offsets = np.concatenate([[0], np.cumsum(np.bincount(category, minlength=n_categories))])
    return (order + id_start).astype(np.int64), offsets


def _pick_in_category(
    grouped: tuple[np.ndarray, np.ndarray], category: np.ndarray, rng: np.random.Generator, exponent: float
) -> np.ndarray:
    # u**exponent piles picks onto the first items of each category: a cheap popularity skew.
    items, offsets = grouped
    size = offsets[category + 1] - offsets[category]
    rank = np.minimum((rng.random(category.size) ** exponent * size).astype(np.int64), size - 1)
    return items[offsets[category] + rank]


def _pick_surfaces(config: SyntheticConfig, rng: np.random.Generator, n: int) -> np.ndarray:
    shares = np.array([s.traffic_share for s in config.surfaces], dtype=np.float64)
    cumulative = np.cumsum(shares / shares.sum())
    picked = np.searchsorted(cumulative, rng.random(n), side="right")
    return np.minimum(picked, len(shares) - 1).astype(np.int64)


def _organic_items(
    config: SyntheticConfig, catalog: _Catalog, rng: np.random.Generator, interest: np.ndarray
) -> np.ndarray:
    in_interest = rng.random(interest.size) < config.organic_interest_share
    category = np.where(in_interest, interest, rng.integers(0, config.n_categories, interest.size))
    return _pick_in_category(catalog.organic_by_category, category, rng, config.popularity_exponent)


def _ad_items(
    config: SyntheticConfig,
    catalog: _Catalog,
    users: _Users,
    rng: np.random.Generator,
    user: np.ndarray,
    interest: np.ndarray,
    retargeting_active: bool,
) -> tuple[np.ndarray, float]:
    """The ad items of the day's impressions (in time order), and the share that retargets an early item."""
    n = user.size
    targeted = rng.random(n) < config.ad_targeting_share
    category = np.where(targeted, interest, rng.integers(0, config.n_categories, n))
    item = _pick_in_category(catalog.ads_by_category, category, rng, config.popularity_exponent)
    if not retargeting_active:
        return item, 0.0
    if config.retarget_every_days == 1:
        retarget = rng.random(n) < config.retarget_share
        slot = rng.integers(0, config.early_items_per_user, n)
        return np.where(retarget, users.early_items[user, slot], item), config.retarget_share
    # Recurring: a retarget_share of the impressions would retarget; a user's first of them that day show
    # the user's early items, one each, and the rest stay as drawn.
    chosen = np.flatnonzero(rng.random(n) < config.retarget_share)
    order = np.argsort(user[chosen], kind="stable")
    grouped = user[chosen][order]
    rank = np.empty(chosen.size, dtype=np.int64)
    rank[order] = np.arange(chosen.size) - np.searchsorted(grouped, grouped)
    first = rank < config.early_items_per_user
    retarget = chosen[first]
    item[retarget] = users.early_items[user[retarget], rank[first]]
    return item, retarget.size / n if n else 0.0


def _early_views(config: SyntheticConfig, users: _Users, day_index: int) -> tuple[np.ndarray, np.ndarray]:
    if day_index >= config.early_days:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    user, slot = np.nonzero(users.early_day == day_index)
    return user.astype(np.int64), users.early_items[user, slot]


def _ad_labels(
    config: SyntheticConfig,
    catalog: _Catalog,
    users: _Users,
    rng: np.random.Generator,
    user: np.ndarray,
    item: np.ndarray,
    surface: np.ndarray,
    interest: np.ndarray,
    retargeting_active: bool,
    retarget_share: float,
    day_index: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Click and conversion labels of ad impressions, and the probabilities they were drawn with (P(click),
    P(click and conversion))."""
    ad = item - config.ad_id_start
    category = catalog.category[item]
    matches = category == interest
    if retargeting_active:
        seen_early = (users.early_items[user] == item[:, None]).any(axis=1)
    else:
        seen_early = np.zeros(user.size, dtype=bool)

    click_quality, conversion_quality = _ad_quality(config, catalog, day_index)
    ctr = np.array([s.ctr * (1.0 + s.ctr_drift) ** day_index for s in config.surfaces])[surface]
    p_click = (
        ctr
        * users.age_surface[users.age_bucket[user], surface]
        * users.segment_category[users.segment[user], category]
        * click_quality[ad]
        * np.where(matches, config.interest_ctr_lift, 1.0)
        * np.where(seen_early, config.retarget_ctr_lift, 1.0)
        / _click_lift_mean(config, retarget_share)
    )
    cvr = np.array([s.cvr or 0.0 for s in config.surfaces])[surface]
    p_conversion = (
        cvr
        * conversion_quality[ad]
        * np.where(seen_early, config.retarget_cvr_lift, 1.0)
        / (1.0 + (config.retarget_cvr_lift - 1.0) * _retarget_share_of_clicks(config, retarget_share))
    )
    p_click, p_conversion = np.minimum(p_click, 0.95), np.minimum(p_conversion, 0.95)
    click = rng.random(user.size) < p_click
    conversion = click & (rng.random(user.size) < p_conversion)
    return click.astype(np.int8), conversion.astype(np.int8), p_click, p_click * p_conversion


def _click_lift_mean(config: SyntheticConfig, share: float) -> float:
    """The expected interest x retargeting lift over impressions (`share` of them retargeting), so surface CTRs
    keep their base rates."""
    return _other_click_lift(config, share) + _retarget_click_lift(config, share)


def _retarget_share_of_clicks(config: SyntheticConfig, share: float) -> float:
    # Retargeting impressions are clicked more often, so they are a larger share of clicks than of impressions.
    return _retarget_click_lift(config, share) / _click_lift_mean(config, share)


def _other_click_lift(config: SyntheticConfig, share: float) -> float:
    chance_match = 1.0 / config.n_categories
    targeted_match = config.ad_targeting_share + (1.0 - config.ad_targeting_share) * chance_match
    return (1.0 - share) * (1.0 + (config.interest_ctr_lift - 1.0) * targeted_match)


def _retarget_click_lift(config: SyntheticConfig, share: float) -> float:
    # Early items are drawn without regard to interest, so they match it only by chance.
    chance_match = 1.0 / config.n_categories
    return share * config.retarget_ctr_lift * (1.0 + (config.interest_ctr_lift - 1.0) * chance_match)


def _nullable_int8(name: str, values: np.ndarray, valid: np.ndarray) -> pl.Series:
    return pl.Series(name, pa.array(values, type=pa.int8(), mask=~valid))
