"""What a benchmark's result file says about the source it ran from."""

from __future__ import annotations

from benchmarks import common


def test_a_copied_trees_commit_is_clean_only_when_said_so(monkeypatch):
    monkeypatch.setenv("GEM_SOURCE_COMMIT", "abc1234")
    for said, dirty in ((None, None), ("1", True), ("0", False)):
        if said is None:
            monkeypatch.delenv("GEM_SOURCE_DIRTY", raising=False)
        else:
            monkeypatch.setenv("GEM_SOURCE_DIRTY", said)
        assert common.commit.__wrapped__() == {"commit": "abc1234", "dirty": dirty}

