"""Memory settings for the length of a build: keep freed large buffers in the process heap, and use
small pages.

glibc hands every large block (over 128 KiB) straight back to the kernel when freed, so each range
of users a build processes would fault its arrays in afresh; on VMs that back guest memory lazily
that is slow. Raising the mmap and trim thresholds for the duration lets later
ranges reuse pages already touched; afterwards the thresholds go back to glibc's defaults and the
heap is trimmed, so the process keeps no extra memory. A no-op where libc is not glibc.

NumPy asks for transparent huge pages for every array of 4 MiB or more. A huge page is a fresh 2 MiB
block, and where the hypervisor takes back the guest's free blocks (a balloon with free page
reporting, as on the 2-core benchmark VM) each one has to be backed again on first touch, while
small pages mostly come from memory the guest touched recently. There, huge pages made cold builds
of 10.7 M events slower and far less steady (in four interleaved pairs: median 2.01 s against 1.91 s,
and one build spent 2.7 s in the kernel against 0.8-1.2 s with small pages). So the process's huge
pages are switched off for the build (prctl PR_SET_THP_DISABLE) and back on after; a no-op where
Linux refuses it.
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
_PR_SET_THP_DISABLE = 41
_PR_GET_THP_DISABLE = 42


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
    thp_was_disabled = libc.prctl(_PR_GET_THP_DISABLE, 0, 0, 0, 0)
    if thp_was_disabled == 0:
        libc.prctl(_PR_SET_THP_DISABLE, 1, 0, 0, 0)
    try:
        yield
    finally:
        if thp_was_disabled == 0:
            libc.prctl(_PR_SET_THP_DISABLE, 0, 0, 0, 0)
        libc.mallopt(_M_MMAP_THRESHOLD, _GLIBC_DEFAULT)
        libc.mallopt(_M_TRIM_THRESHOLD, _GLIBC_DEFAULT)
        libc.malloc_trim(0)
