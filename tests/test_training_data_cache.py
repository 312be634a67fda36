"""GEM_TEST_DATA_CACHE: the tests' prepared data kept by its arguments, read back without preparing it again."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests import training_data

SMALL = dict(days=3, eval_days=1, max_history_len=8, sub_batch_size=8, n_users=40, n_items=200)


def test_data_prepared_once_is_read_back_and_other_arguments_prepare_their_own(tmp_path, monkeypatch):
    monkeypatch.setenv("GEM_TEST_DATA_CACHE", str(tmp_path / "cache"))
    first = training_data.learnable_data(tmp_path / "a", **SMALL)
    assert first.sequence_logs.parent.parent == tmp_path / "cache" and not (tmp_path / "a").exists()

    def prepare_again(*args):
        raise AssertionError("prepared again")

    monkeypatch.setattr(training_data, "_prepare", prepare_again)
    again = training_data.learnable_data(tmp_path / "b", **SMALL)
    assert again.sequence_logs == first.sequence_logs and again.plans == first.plans
    with pytest.raises(AssertionError, match="prepared again"):
        training_data.learnable_data(tmp_path / "c", **{**SMALL, "n_users": 41})
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [first.sequence_logs.parent.name]  # nothing half-made


def test_what_the_cache_holds_is_read_without_polars(tmp_path, monkeypatch):
    monkeypatch.setenv("GEM_TEST_DATA_CACHE", str(tmp_path / "cache"))
    training_data.learnable_data(tmp_path, **SMALL)
    # A fresh interpreter where importing polars fails, as on the GPU machine.
    code = ("import sys; sys.modules['polars'] = None\n"
            "from tests.training_data import learnable_data\n"
            f"logs = learnable_data(None, **{SMALL!r}).open()\n"
            "print(len(logs.surfaces))")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                          text=True, env={"GEM_TEST_DATA_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.strip()) > 0
