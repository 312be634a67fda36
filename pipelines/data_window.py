"""The days a local run covers, read from the data its run config names: the Parquet files a
`parquet_template` matches, or the days the MovieLens sample is replayed onto. The synthetic log has no
days of its own (None: the runner's defaults)."""

from __future__ import annotations

import glob
import re
from dataclasses import dataclass
from datetime import date, timedelta

from gem_ops.data.raw_event_logs import parquet_path
from gem_ops.data.synthetic import SyntheticConfig

MOVIELENS_REPLAY_DAYS = 14  # raw_event_logs' default


@dataclass(frozen=True)
class DataWindow:
    first: date  # the oldest day with data
    end: date  # the newest

    def days(self, lookback: int) -> int:
        """Days the run materializes: the look-back before `end`, as far as the data reaches."""
        return min(lookback, (self.end - self.first).days + 1)


def landed_days(template: str) -> list[str]:
    """The days (ISO) for which a file of `template` (a path with {date}) exists, sorted."""
    parquet_path(template, date(2000, 1, 1))  # the template's own check: one {date} and nothing else
    pattern = re.compile(re.escape(template).replace(re.escape("{date}"), r"(\d{4}-\d{2}-\d{2})") + r"\Z")
    days = {m.group(1) for path in glob.glob(template.replace("{date}", "*")) if (m := pattern.match(path))}
    return sorted(d for d in days if _is_day(d))


def _is_day(text: str) -> bool:
    try:
        date.fromisoformat(text)
    except ValueError:  # shaped like a date but none (2026-13-01)
        return False
    return True


def data_window(run_config: dict) -> DataWindow | None:
    """Where the configured raw_event_logs source has data; None for the synthetic log."""
    raw = run_config.get("ops", {}).get("raw_event_logs", {}).get("config", {})
    source = raw.get("source", "synthetic")
    if source == "parquet":
        template = raw.get("parquet_template", "")
        days = landed_days(template)
        if not days:
            raise ValueError(f"ops.raw_event_logs.config.parquet_template: no file matches {template!r}")
        return DataWindow(date.fromisoformat(days[0]), date.fromisoformat(days[-1]))
    if source == "movielens":
        start = SyntheticConfig().start_date  # where the sample's replay begins (raw_event_logs.load_day)
        replayed = int(raw.get("movielens_replay_days", MOVIELENS_REPLAY_DAYS))
        return DataWindow(start, start + timedelta(days=replayed - 1))
    return None
