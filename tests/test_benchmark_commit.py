"""What a benchmark's result file says about the source it ran from."""

from __future__ import annotations

import os
import subprocess

from benchmarks import common
from benchmarks.source_tree import source_tree


def test_a_copied_trees_commit_is_clean_only_when_said_so(monkeypatch):
    monkeypatch.setenv("GEM_SOURCE_COMMIT", "abc1234")
    for said, dirty in ((None, None), ("1", True), ("0", False)):
        if said is None:
            monkeypatch.delenv("GEM_SOURCE_DIRTY", raising=False)
        else:
            monkeypatch.setenv("GEM_SOURCE_DIRTY", said)
        said_commit = common.commit.__wrapped__()
        assert {k: said_commit[k] for k in ("commit", "dirty")} == {"commit": "abc1234", "dirty": dirty}
        assert len(said_commit["tree"]) == 40  # the files themselves, whatever the caller says


def _git(repo, *args, **env):
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True,
                          env={**os.environ, **env}).stdout.strip()


def test_the_source_tree_id_is_gits_own_for_the_files_as_they_are(tmp_path):
    repo = tmp_path / "repo"
    (repo / "a").mkdir(parents=True)
    (repo / "a" / "inner.py").write_text("x = 1\n")
    (repo / "a.txt").write_text("a file named like the folder, sorted before it\n")  # git's "a/" > "a.txt"
    (repo / "a-b").write_text("")
    (repo / "run.sh").write_text("#!/bin/sh\n")
    (repo / "run.sh").chmod(0o755)
    (repo / "link").symlink_to("a.txt")
    (repo / ".gitignore").write_text("ignored/\n")
    (repo / "ignored").mkdir()
    (repo / "ignored" / "big.bin").write_bytes(b"\0" * 100)
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", "commit", "-qm", "c")
    assert source_tree(repo) == _git(repo, "rev-parse", "HEAD^{tree}")

    # changed, added and deleted files since the index was written (a copied tree beside a stale .git): the id
    # is the next commit's, and neither the index nor the object store changed on the way
    (repo / "a" / "inner.py").write_text("x = 2\n")
    (repo / "new.py").write_text("")
    (repo / "a-b").unlink()
    before = _git(repo, "count-objects", "-v"), (repo / ".git" / "index").read_bytes()
    changed = source_tree(repo)
    assert (_git(repo, "count-objects", "-v"), (repo / ".git" / "index").read_bytes()) == before
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", "commit", "-qm", "d")
    assert changed == _git(repo, "rev-parse", "HEAD^{tree}") != _git(repo, "rev-parse", "HEAD~1^{tree}")


def test_no_tree_id_without_a_checkout(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # even where the temp folder sits in a checkout
    assert source_tree(tmp_path) is None
