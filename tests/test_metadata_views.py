"""The run page's calibration table reads a fitted calibration's record as a person asks about it: which days'
rate each group aims at, and whether a trend moved it."""

from gem_ops.metadata_views import calibration_table


def test_the_calibration_table_names_each_groups_rate_and_trend():
    record = {"scale": [[0.9, 1.1], [1.0, 0.8]], "shift": [[-0.2, 0.1], [0.0, 0.3]],
              "rate_days": [[1, 3], [0, 1]], "target_rate": [[0.03, 0.1], [0.02, 0.05]],
              "trend_slope": [[0.06, 0.0], [-0.01, 0.0]], "trend_standard_error": [[0.02, 0.03], [0.02, 0.0]],
              "trend_taken": [[True, False], [False, False]]}
    rows = {r["group"]: r for r in calibration_table(record, ("feed", "reels"), ("click", "conversion")).records}
    assert [rows[g]["rate_from"] for g in ("feed/click", "feed/conversion", "reels/click")] == [
        "held-out day", "newest 3 days", "every day"]
    assert rows["feed/click"]["trend_taken"] and rows["feed/click"]["trend_per_day"] == 0.06
    assert rows["feed/conversion"]["trend_per_day"] == 0.0
    assert rows["reels/conversion"]["trend_per_day"] is None  # too few days to fit: an empty cell, not a zero
    assert rows["reels/conversion"]["shift"] == 0.3 and rows["feed/conversion"]["target_rate"] == 0.1
    # Plain Platt scaling records no pool and no trend.
    (row,) = calibration_table({"scale": [[1.2]], "shift": [[-0.4]]}, ("feed",), ("click",)).records
    assert row == {"group": "feed/click", "scale": 1.2, "shift": -0.4, "rate_from": "held-out day",
                   "target_rate": None, "trend_per_day": None, "trend_taken": False}
