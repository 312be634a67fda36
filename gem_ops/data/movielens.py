"""MovieLens adapter: turns the bundled ml-latest-small sample into an event log in the canonical schema.

Mapping
    - Every rating becomes one event: event_type "rating", label_click = 1 (the user chose to rate the
      movie), label_conversion = 1 if the rating is >= 4 stars else 0.
    - For every rating, `negatives_per_rating` movies that the user never rated are drawn uniformly
      (with replacement) from the catalog (movies.csv) and become "sampled_negative" events at the
      same timestamp, with label_click = 0 and label_conversion = 0. They are candidates only, never
      history: MOVIELENS_HISTORY_EVENT_TYPES names the event types that form a user's timeline.
    - surface: a genre group of the movie's first listed genre
          action  Action, Adventure, Sci-Fi, Thriller, War, Western
          comedy  Comedy, Romance, Musical, Children, Animation, Fantasy
          drama   Drama, Crime, Mystery, Film-Noir, Horror, Documentary, IMAX
          other   "(no genres listed)" and anything else
    - item_genre (sparse): id of the movie's first listed genre (MOVIELENS_GENRE_IDS; 0 for
      "(no genres listed)" and unknown names).
    - item_year (dense, Float32): release year parsed from the title ("Heat (1995)"; a series'
      "(1975-1979)" gives 1975); titles without a year get the catalog's median year.
    - No user features beyond user_id (the sample has no demographics).

Timestamps
    The sample spans 1995-2016, but the pipeline partitions by day on a recent calendar. The adapter
    therefore replays it onto [replay_start, replay_start + replay_days) (UTC midnight) with one linear
    map of the original seconds to milliseconds: the earliest rating lands on replay_start, the latest
    on the window's last millisecond. The map keeps the order of events and the ratios of the gaps
    between them, so activity bursts stay bursts (about 3.5 ms of replay per original second at the
    defaults); days in the window are therefore unevenly filled, as the original years were.
    The output is sorted by timestamp (ties: by user, then each rating before its negatives).
"""

from __future__ import annotations

import errno
import os
from datetime import date
from pathlib import Path

import numpy as np
import polars as pl

from gem_ops.data.schema import TIMESTAMP_DTYPE

DEFAULT_MOVIELENS_DIR = Path(__file__).resolve().parents[2] / "data" / "movielens" / "ml-latest-small"

RATING = "rating"
SAMPLED_NEGATIVE = "sampled_negative"
MOVIELENS_HISTORY_EVENT_TYPES = (RATING,)

CONVERSION_MIN_RATING = 4.0

SURFACE_GENRES = {
    "action": ("Action", "Adventure", "Sci-Fi", "Thriller", "War", "Western"),
    "comedy": ("Comedy", "Romance", "Musical", "Children", "Animation", "Fantasy"),
    "drama": ("Drama", "Crime", "Mystery", "Film-Noir", "Horror", "Documentary", "IMAX"),
}
OTHER_SURFACE = "other"
SURFACES = (*SURFACE_GENRES, OTHER_SURFACE)

NO_GENRE_ID = 0
MOVIELENS_GENRE_IDS = {
    genre: index
    for index, genre in enumerate(sorted(g for genres in SURFACE_GENRES.values() for g in genres), start=1)
}
# The README spells it "Children's"; the data files spell it "Children".
_GENRE_ALIASES = {"Children's": "Children"}

MS_PER_DAY = 86_400_000
_YEAR_PATTERN = r"\((\d{4})(?:-\d{0,4})?\)\s*$"


def load_movielens(
    path: str | os.PathLike = DEFAULT_MOVIELENS_DIR,
    *,
    negatives_per_rating: int = 1,
    seed: int = 0,
    replay_start: date = date(2026, 11, 1),
    replay_days: int = 28,
) -> pl.DataFrame:
    """Reads a MovieLens folder (ratings.csv, movies.csv) into an event log; see the module doc."""
    if negatives_per_rating < 0:
        raise ValueError(f"negatives_per_rating must be >= 0, got {negatives_per_rating}")
    if replay_days < 1:
        raise ValueError(f"replay_days must be >= 1, got {replay_days}")
    ratings = _read_ratings(_require_file(Path(path), "ratings.csv"))
    movies = _read_movies(_require_file(Path(path), "movies.csv"))

    # Rows in a fixed order, so the seeded negative draws do not depend on the file's row order.
    ratings = ratings.sort("userId", "timestamp", "movieId")
    catalog = np.unique(np.concatenate([movies["movieId"].to_numpy(), ratings["movieId"].to_numpy()]))
    genre, surface, year = _catalog_features(movies, catalog)

    user = ratings["userId"].to_numpy()
    rated = np.searchsorted(catalog, ratings["movieId"].to_numpy())
    negatives = _sample_negatives(user, rated, catalog.size, negatives_per_rating, np.random.default_rng(seed))

    # One block per rating: the rating, then its negatives.
    per_block = 1 + negatives_per_rating
    position = np.column_stack([rated, negatives]).ravel()
    is_rating = np.zeros((len(rated), per_block), dtype=bool)
    is_rating[:, 0] = True
    is_rating = is_rating.ravel()
    conversion = np.zeros((len(rated), per_block), dtype=np.int8)
    conversion[:, 0] = ratings["rating"].to_numpy() >= CONVERSION_MIN_RATING
    timestamp = np.repeat(_replay_ms(ratings["timestamp"].to_numpy(), replay_start, replay_days), per_block)

    frame = pl.DataFrame(
        [
            pl.Series("user_id", np.repeat(user, per_block).astype(np.int64)),
            pl.Series("timestamp", timestamp).cast(pl.Datetime("ms")).dt.replace_time_zone("UTC"),
            pl.Series("item_id", catalog[position].astype(np.int64)),
            pl.Series(SURFACES, dtype=pl.String).gather(surface[position]).alias("surface"),
            pl.Series([SAMPLED_NEGATIVE, RATING], dtype=pl.String).gather(is_rating.astype(np.uint32)).alias(
                "event_type"
            ),
            pl.Series("label_click", is_rating.astype(np.int8)),
            pl.Series("label_conversion", conversion.ravel()),
            pl.Series("item_genre", genre[position]),
            pl.Series("item_year", year[position]),
        ]
    ).with_columns(pl.col("timestamp").cast(TIMESTAMP_DTYPE))
    return frame.sort("timestamp", maintain_order=True)


def _require_file(folder: Path, name: str) -> Path:
    file = folder / name
    if not file.is_file():
        raise FileNotFoundError(errno.ENOENT, f"MovieLens file not found (expected {name} in {folder})", str(file))
    return file


def _read_ratings(file: Path) -> pl.DataFrame:
    schema = {"userId": pl.Int64, "movieId": pl.Int64, "rating": pl.Float64, "timestamp": pl.Int64}
    return pl.read_csv(file, schema_overrides=schema, columns=list(schema))


def _read_movies(file: Path) -> pl.DataFrame:
    schema = {"movieId": pl.Int64, "title": pl.String, "genres": pl.String}
    return pl.read_csv(file, schema_overrides=schema, columns=list(schema))


def _catalog_features(movies: pl.DataFrame, catalog: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Genre id, surface index and release year for each catalog position."""
    genre_of_surface = {g: i for i, genres in enumerate(SURFACE_GENRES.values()) for g in genres}
    other = SURFACES.index(OTHER_SURFACE)
    first_genre = (
        movies["genres"].fill_null("").str.split("|").list.first().str.strip_chars().replace(_GENRE_ALIASES)
    )
    features = pl.DataFrame(
        {
            "movieId": movies["movieId"],
            "genre": first_genre.replace_strict(MOVIELENS_GENRE_IDS, default=NO_GENRE_ID, return_dtype=pl.Int64),
            "surface": first_genre.replace_strict(genre_of_surface, default=other, return_dtype=pl.UInt32),
            "year": movies["title"].str.extract(_YEAR_PATTERN, 1).cast(pl.Float32),
        }
    ).unique("movieId", keep="first", maintain_order=True)
    median_year = features["year"].median()
    # Rated movies missing from movies.csv keep the defaults: no genre, "other", median year.
    aligned = (
        pl.DataFrame({"movieId": catalog})
        .join(features, on="movieId", how="left", maintain_order="left")
        .with_columns(
            pl.col("genre").fill_null(NO_GENRE_ID),
            pl.col("surface").fill_null(other),
            pl.col("year").fill_null(median_year if median_year is not None else 0.0).cast(pl.Float32),
        )
    )
    return aligned["genre"].to_numpy(), aligned["surface"].to_numpy(), aligned["year"].to_numpy()


def _sample_negatives(
    user: np.ndarray, rated: np.ndarray, n_movies: int, per_rating: int, rng: np.random.Generator
) -> np.ndarray:
    """Catalog positions, shape (ratings, per_rating), of movies each row's user never rated."""
    if per_rating == 0:
        return np.empty((user.size, 0), dtype=np.int64)
    _, user_index = np.unique(user, return_inverse=True)
    rated_keys = np.unique(user_index * n_movies + rated)
    if (np.bincount(rated_keys // n_movies) >= n_movies).any():
        raise ValueError("a MovieLens user rated every movie in the catalog: no negatives can be sampled")
    owner = np.repeat(user_index, per_rating)
    sampled = rng.integers(0, n_movies, owner.size)
    # Rejection sampling: redraw the hits on rated movies until none is left.
    pending = np.arange(owner.size)
    while pending.size:
        keys = owner[pending] * n_movies + sampled[pending]
        slot = np.minimum(np.searchsorted(rated_keys, keys), rated_keys.size - 1)
        pending = pending[rated_keys[slot] == keys]
        sampled[pending] = rng.integers(0, n_movies, pending.size)
    return sampled.reshape(-1, per_rating)


def _replay_ms(seconds: np.ndarray, replay_start: date, replay_days: int) -> np.ndarray:
    """Linear, order-preserving map of Unix seconds onto the replay window, in epoch milliseconds."""
    start_ms = (replay_start - date(1970, 1, 1)).days * MS_PER_DAY
    if seconds.size == 0:
        return seconds.astype(np.int64)
    first, last = int(seconds.min()), int(seconds.max())
    scale = (replay_days * MS_PER_DAY - 1) / max(last - first, 1)
    return start_ms + np.floor((seconds - first) * scale).astype(np.int64)
