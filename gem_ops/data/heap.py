"""Keep freed large buffers in the process heap while a build runs.

glibc hands every large block (over 128 KiB) straight back to the kernel when freed, so each range
of users a build processes would fault its arrays in afresh; on VMs that back guest memory lazily
that is slow. Raising the mmap and trim thresholds for the duration lets later
ranges reuse pages already touched; afterwards the thresholds go back to glibc's defaults and the
heap is trimmed, so the process keeps no extra memory. A no-op where libc is not glibc.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import platform
from collections.abc import Iterator

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_GLIBC_DEFAULT = 128 * 1024


def _glibc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


@contextlib.contextmanager
def reusable_heap(max_block_bytes: int = 1 << 30) -> Iterator[None]:
    libc = _glibc()
    if libc is None:
        yield
        return
    libc.mallopt(_M_MMAP_THRESHOLD, max_block_bytes)
    libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    try:
        yield
    finally:
        libc.mallopt(_M_MMAP_THRESHOLD, _GLIBC_DEFAULT)
        libc.mallopt(_M_TRIM_THRESHOLD, _GLIBC_DEFAULT)
        libc.malloc_trim(0)
