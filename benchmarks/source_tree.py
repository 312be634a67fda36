"""The git tree id of a checkout's files as they are, computed without writing to its .git.

A result file names the commit its run says it came from; on a machine that holds a copied tree with a stale
.git (the GPU machine), that name is only what the caller passed. The tree id is what git would store for the
files themselves: `git rev-parse <commit>^{tree}` equals it exactly when the run's files are that commit's.
"""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
from pathlib import Path


def source_tree(root: Path) -> str | None:
    """The tree id of every file git would add at `root` (tracked or untracked, not ignored); None without git."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                                capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    tree: dict = {}
    for name in sorted(set(filter(None, listed.decode().split("\0")))):
        entry = _blob(root / name)
        if entry is None:  # listed by a stale index, gone from the tree
            continue
        *folders, file = name.split("/")
        node = tree
        for folder in folders:
            node = node.setdefault(folder, {})
        node[file] = entry
    return _tree_id(tree)


def _object_id(kind: str, body: bytes) -> str:
    return hashlib.sha1(f"{kind} {len(body)}\0".encode() + body).hexdigest()


def _blob(path: Path) -> tuple[str, str] | None:
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(mode):
        return "120000", _object_id("blob", os.readlink(path).encode())
    if stat.S_ISDIR(mode):  # a nested repository (gitlink): its own tree, not this one's
        return None
    return ("100755" if mode & stat.S_IXUSR else "100644"), _object_id("blob", path.read_bytes())


def _tree_id(node: dict) -> str:
    # git orders a tree's entries by name, a subtree's name compared as if it ended in "/"
    entries = sorted(node.items(), key=lambda item: item[0] + "/" if isinstance(item[1], dict) else item[0])
    body = b""
    for name, value in entries:
        mode, object_id = ("40000", _tree_id(value)) if isinstance(value, dict) else value
        body += f"{mode} {name}\0".encode() + bytes.fromhex(object_id)
    return _object_id("tree", body)
