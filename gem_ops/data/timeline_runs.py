"""Events put in (user, time) order for sequence_logs: a check that parts can be merged as they are, a global sort
where they cannot, and the runs (TimelineRuns) that give each user's timeline and each request's pointers into it."""

from __future__ import annotations

import math

import numpy as np
import polars as pl

from gem_ops.data.raw_event_reading import Events


def _is_user_time_sorted(user: np.ndarray, ts: np.ndarray) -> bool:
    du, dt = np.diff(user), np.diff(ts)
    return bool(np.all((du > 0) | ((du == 0) & (dt >= 0))))


def mergeable(user: np.ndarray, ts: np.ndarray, part_offsets: np.ndarray) -> bool:
    """Every part sorted by (user, time), and the parts cover disjoint times, in order."""
    bounds = [(a, b) for a, b in zip(part_offsets[:-1], part_offsets[1:]) if b > a]
    parts_sorted = all(_is_user_time_sorted(user[a:b], ts[a:b]) for a, b in bounds)
    # A part is sorted by user first, so its last row need not be its latest event: compare max with min.
    return parts_sorted and all(ts[a1:b1].max() < ts[a2:b2].min() for (a1, b1), (a2, b2) in zip(bounds, bounds[1:]))


def sort_order(user: np.ndarray, ts: np.ndarray) -> np.ndarray:
    """Stable (user, time) order; one packed integer key when the value ranges allow it."""
    u0, t0 = user.min(), ts.min()
    user_bits, time_bits = int(user.max() - u0).bit_length(), int(ts.max() - t0).bit_length()
    if user_bits + time_bits <= 63:
        key = ((user - u0) << time_bits) | (ts - t0)
        return _stable_argsort(key)
    return _stable_argsort(user, ts)


def _stable_argsort(*keys: np.ndarray) -> np.ndarray:
    frame = pl.DataFrame({f"k{i}": k for i, k in enumerate(keys)})
    return frame.select(pl.arg_sort_by(frame.columns, maintain_order=True)).to_series().to_numpy()


class TimelineRuns:
    """A user's events within one part, in input order, form a run: parts are sorted by (user, time)
    and cover disjoint times in order (raw_event_logs stores each day so), so a user's timeline is the
    concatenation of their runs in part order. Sorting the runs (stably, by user) is the whole sort,
    and the gathers that follow read memory in runs, not at random.

    A request's history_end is the number of its user's timeline events in earlier runs plus those
    before its instant (its first event at the same time) in its own run: per run, one number (`base`)
    that is broadcast over the run in input order, so pointers need no scatter of per-event arrays.
    """

    def __init__(self, events: Events, history_codes: list[int] | None):
        user, n = events.columns["user_id"], events.n
        # Positions and counts as int32 while they fit: half the memory traffic of int64.
        self.index = index = np.int32 if n < 2**31 else np.int64
        new_run = np.empty(n, dtype=bool)
        new_run[0] = True
        np.not_equal(user[1:], user[:-1], out=new_run[1:])
        inner = events.part_offsets[1:-1]
        new_run[inner[inner < n]] = True
        self.start = np.flatnonzero(new_run).astype(index)
        del new_run
        self.length = np.diff(self.start, append=index(n))
        run_user = user[self.start]
        # Runs appear in part order, so a stable sort by user keeps each user's runs in time order;
        # the runs' user ids are a few sorted sequences, which numpy's stable sort (timsort) merges.
        self.order = np.argsort(run_user, kind="stable").astype(index)
        sorted_start, sorted_length = self.start[self.order], self.length[self.order]
        sorted_user = run_user[self.order]
        del run_user
        new_user = np.empty(len(sorted_user), dtype=bool)
        new_user[0] = True
        np.not_equal(sorted_user[1:], sorted_user[:-1], out=new_user[1:])
        self.first_run = np.flatnonzero(new_user)  # in sorted order, each user's first run
        self.user_ids = sorted_user[self.first_run]
        del sorted_user
        self.user_events = np.add.reduceat(sorted_length, self.first_run, dtype=np.int64)
        # Timeline events (all events, or those of the history event types) per run and before each run.
        if history_codes is None:
            self.is_hist = self.hist_before = None
            sorted_counted = sorted_length
        else:
            self.is_hist = np.isin(events.columns["event_type"], history_codes)
            self.hist_before = np.zeros(n + 1, dtype=index)
            np.cumsum(self.is_hist, out=self.hist_before[1:])
            sorted_counted = self.hist_before[sorted_start + sorted_length] - self.hist_before[sorted_start]
        self.timeline_lengths = (self.user_events if history_codes is None
                                 else np.add.reduceat(sorted_counted, self.first_run, dtype=np.int64))
        # The user's timeline events in earlier runs, less the count before the run's own start, so
        # that adding the count before an event's instant gives its history_end.
        base = np.cumsum(sorted_counted, dtype=index)
        base -= sorted_counted
        base -= np.repeat(base[self.first_run], np.diff(self.first_run, append=len(base)))
        base -= sorted_start if self.hist_before is None else self.hist_before[sorted_start]
        # Per run, in input order: its user's row (from 0) and its base.
        self.base = np.empty(len(self.start), dtype=index)
        self.base[self.order] = base
        self.row = np.empty(len(self.start), dtype=np.int32)
        self.row[self.order] = np.cumsum(new_user, dtype=np.int32) - 1

    def user_chunks(self, chunk_events: int):
        """Consecutive user ranges [first, last) of about chunk_events events."""
        n_users = len(self.user_ids)
        total = int(self.user_events.sum())
        n_chunks = min(n_users, math.ceil(total / chunk_events))
        cuts = np.searchsorted(np.cumsum(self.user_events), np.arange(1, n_chunks) * (total / n_chunks), side="right")
        bounds = np.unique(np.concatenate([[0], cuts, [n_users]]))
        return list(zip(bounds[:-1].tolist(), bounds[1:].tolist()))

    def positions(self, first_user: int, last_user: int) -> np.ndarray:
        """Input positions of the timeline events of users [first_user, last_user), in (user, time) order."""
        r0 = self.first_run[first_user]
        r1 = self.first_run[last_user] if last_user < len(self.first_run) else len(self.order)
        runs = self.order[r0:r1]
        start, length = self.start[runs], self.length[runs]
        # A running sum of steps (1 inside a run, a jump between runs): one array, no temporaries;
        # int32 while it fits, which halves the index traffic of every gather that follows.
        pos = np.ones(int(length.sum()), dtype=self.index)
        pos[0] = start[0]
        pos[np.cumsum(length[:-1])] = start[1:] - (start[:-1] + length[:-1] - 1)
        np.cumsum(pos, out=pos)
        return pos if self.is_hist is None else pos[self.is_hist[pos]]

    def pointers(self, events: Events, start: int, stop: int, user_base: int,
                 rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """user_row and history_end of the events at input positions [start, stop), a whole number of
        runs, or of those of them at `rows` (offsets from start)."""
        r0, r1 = np.searchsorted(self.start, [start, stop])
        user, ts = events.columns["user_id"][start:stop], events.columns["timestamp"][start:stop]
        new_instant = np.empty(stop - start, dtype=bool)
        new_instant[0] = True
        new_instant[1:] = (ts[1:] != ts[:-1]) | (user[1:] != user[:-1])
        instant_start = np.where(new_instant, np.arange(start, stop, dtype=self.index), self.index(0))
        np.maximum.accumulate(instant_start, out=instant_start)
        run = np.repeat(np.arange(r0, r1, dtype=self.index), self.length[r0:r1])
        if rows is not None:
            instant_start, run = instant_start[rows], run[rows]
        before = instant_start if self.hist_before is None else self.hist_before[instant_start]
        history_end = self.base[run]
        history_end += before
        user_row = self.row[run]
        user_row += np.int32(user_base)
        return user_row, history_end.astype(np.int32, copy=False)
