"""A trend in what the model cannot see, carried one day forward into its calibration.

A model without the date learns each group's rate as it was on average over its training days; its calibration puts
it at the held-out day's rate. Where a group's rate trends (a surface gaining clicks day after day), the model's
residual, log(labels / calibrated predictions) day by day, trends with it, and the day it serves lies one step
further along. The residual, unlike the raw label rate, is free of the days' mix of users and ads (the model explains
that), so a trend shows through the labels' noise within a week. Per (domain, task), the slope of the residual over
the newest TREND_DAYS days (the held-out day last) is fitted by weighted least squares; where it differs from zero by
more than TREND_STANDARD_ERRORS standard errors, the group keeps the held-out day's rate (calibration_rate pools no
older days for it) and the shift is moved so the held-out day's mean prediction grows by that slope's one day
(clipped to MAX_DAILY_TREND)."""

from __future__ import annotations

import numpy as np

from gem_ops.train.batches import MS_PER_DAY, examples_of_newest_days
from gem_ops.train.calibration_rate import shift_for_rate

TREND_DAYS = 7  # the newest days, the held-out day last
TREND_EXAMPLES_PER_DAY = 2_000  # training examples scored per day before the held-out one
TREND_STANDARD_ERRORS = 2.0
MAX_DAILY_TREND = 0.25  # log-ratio per day: no more than a 28% step from one fit on a week


def trend_examples(logs, plan_examples: np.ndarray, validation: np.ndarray, seed: int) -> np.ndarray:
    """Up to TREND_EXAMPLES_PER_DAY of the plan's training examples from each of the TREND_DAYS - 1 days before the
    held-out day, sorted (the same on every rank)."""
    training = np.setdiff1d(np.asarray(plan_examples, dtype=np.int64), validation)
    recent = examples_of_newest_days(logs, training, TREND_DAYS - 1) if training.size else training
    day = logs.column("timestamp")[recent] // MS_PER_DAY
    rng = np.random.default_rng(seed)
    picked = [rng.choice(recent[day == d], min(TREND_EXAMPLES_PER_DAY, int((day == d).sum())), replace=False)
              for d in np.unique(day)]
    return np.sort(np.concatenate(picked)) if picked else recent


def residual_trends(days: np.ndarray, probabilities: np.ndarray, labels: np.ndarray, mask: np.ndarray,
                    surface: np.ndarray, domains: int) -> tuple[np.ndarray, np.ndarray]:
    """[domains, tasks] the slope per day of log((labels + 1/2) / (predictions + 1/2)) summed per day, and its standard
    error: weighted least squares, each day weighed by its positives (the ratio's binomial variance is about 1 /
    positives), the error widened by the fit's own scatter where that exceeds the binomial. NaN with fewer than 4
    days."""
    tasks = labels.shape[1]
    slope, error = np.full((domains, tasks), np.nan), np.full((domains, tasks), np.nan)
    for d in range(domains):
        for t in range(tasks):
            rows = mask[:, t] & (surface == d)
            group_days = np.unique(days[rows])
            if group_days.size < 4:
                continue
            y = np.array([labels[rows & (days == g), t].sum() for g in group_days]) + 0.5
            p = np.array([probabilities[rows & (days == g), t].sum() for g in group_days]) + 0.5
            r, w, x = np.log(y / p), y, (group_days - group_days[-1]).astype(np.float64)
            centre = np.sum(w * x) / w.sum()
            spread = np.sum(w * (x - centre) ** 2)
            slope[d, t] = np.sum(w * (x - centre) * (r - np.sum(w * r) / w.sum())) / spread
            fitted = np.sum(w * r) / w.sum() + slope[d, t] * (x - centre)
            scatter = max(1.0, np.sum(w * (r - fitted) ** 2) / (group_days.size - 2))
            error[d, t] = np.sqrt(scatter / spread)
    return slope, error


def find_trends(scale, shift, held: dict, recent: dict, logs, domains: int) -> dict:
    """Each (domain, task)'s residual trend under the calibration (`scale`, `shift`: [domains, tasks], Platt scaling on
    the held-out day): `held` and `recent` are the raw logits, labels, masks, surfaces and example indices of the
    held-out examples and of trend_examples. Returns the slopes, their errors and which are taken (beyond
    TREND_STANDARD_ERRORS), for the record and for step_trends."""
    parts = {k: np.concatenate([held[k].numpy(), recent[k].numpy()]) for k in
             ("logits", "labels", "label_mask", "surface", "example_index")}
    scale_np, shift_np = np.asarray(scale, dtype=np.float64), np.asarray(shift, dtype=np.float64)
    calibrated = parts["logits"] * scale_np[parts["surface"]] + shift_np[parts["surface"]]
    days = logs.column("timestamp")[parts["example_index"]] // MS_PER_DAY
    slope, error = residual_trends(days, 1 / (1 + np.exp(-calibrated)), parts["labels"], parts["label_mask"],
                                   parts["surface"], domains)
    taken = np.nan_to_num(np.abs(slope) / error, nan=0.0) > TREND_STANDARD_ERRORS
    return {"trend_slope": np.nan_to_num(slope).tolist(), "trend_standard_error": np.nan_to_num(error).tolist(),
            "trend_taken": taken.tolist()}


def step_trends(scale, shift, held: dict, trends: dict) -> None:
    """Moves `shift` ([domains, tasks], in place) so that the held-out day's mean prediction of each group whose trend
    is taken grows by its slope's one day (clipped to MAX_DAILY_TREND). The group's shift is to be the held-out
    day's own level (a trending rate is where its newest day put it: calibration_rate keeps it there)."""
    scale_np = np.asarray(scale, dtype=np.float64)
    logits, mask, surface = held["logits"].numpy(), held["label_mask"].numpy(), held["surface"].numpy()
    slope = np.asarray(trends["trend_slope"])
    for d, t in zip(*np.nonzero(np.asarray(trends["trend_taken"]))):
        rows = mask[:, t] & (surface == d)
        if rows.any():
            level = float(shift[d, t])
            mean = np.mean(1 / (1 + np.exp(-(scale_np[d, t] * logits[rows, t] + level))))
            step = np.clip(slope[d, t], -MAX_DAILY_TREND, MAX_DAILY_TREND)
            shift[d, t] = shift_for_rate(logits[rows, t], float(scale_np[d, t]), float(min(mean * np.exp(step), 0.99)))
