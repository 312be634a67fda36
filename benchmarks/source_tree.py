"""The git tree id of a checkout's files as they are, computed without writing to its .git.

A result file names the commit its run says it came from; on a machine that holds a copied tree with a stale
.git (the GPU machine), that name is only what the caller passed. The tree id is what git would store for the
files themselves: `git rev-parse <commit>^{tree}` equals it exactly when the run's files are that commit's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path


def source_tree(root: Path) -> str | None:
    """The tree id of every file git would add at `root` (`git add -A`, then `git write-tree`), git writing into a
    copy of the index and a scratch object directory (the checkout's objects read as an alternate); None without
    git or a checkout."""

    def git(*args: str, env: dict | None = None) -> str:
        return subprocess.run(["git", *args], cwd=root, env=env, capture_output=True, check=True,
                              text=True).stdout.strip()

    try:
        objects, index = (Path(root, git("rev-parse", "--git-path", name)) for name in ("objects", "index"))
        with tempfile.TemporaryDirectory() as scratch:
            env = {**os.environ, "GIT_INDEX_FILE": f"{scratch}/index", "GIT_OBJECT_DIRECTORY": f"{scratch}/objects",
                   "GIT_ALTERNATE_OBJECT_DIRECTORIES": str(objects.resolve())}
            os.mkdir(env["GIT_OBJECT_DIRECTORY"])  # git takes a missing one for no repository
            if index.exists():  # unchanged files are not hashed again; tracked files stay in even where ignored
                shutil.copyfile(index, env["GIT_INDEX_FILE"])
            git("add", "-A", env=env)
            return git("write-tree", env=env)
    except (OSError, subprocess.CalledProcessError):
        return None
