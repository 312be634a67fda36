"""Autotuner choices kept on disk, so that a later process (a resumed job, the next run of a benchmark pair, another
rank on the host) launches the config an earlier one chose instead of timing the configs again.

Why not Triton's own `cache_results`: it refuses configs with pre-hooks, and the attention kernels' configs carry one
(they set their tensor descriptors' block shapes). Timing configs of near-equal speed for tens of milliseconds picks
differently from run to run (of three runs on one H100, every two differed in 1 to 5 of a kernel's 12 keys), and
each pick stays for the whole process: kept on disk, runs compare the same kernels.

A store is a folder of one JSON file per kernel identity: the kernel's name, a hash of its source (Triton's
`cache_key`), of its whole config list, of the Triton version and of the device's name, so that a changed kernel, list,
compiler or GPU model starts empty. Each file maps a tuning key's repr to the chosen config's repr, and is replaced
whole under a lock (read, written aside, renamed). A process tunes a key under a lock of that key (`claim`, one of
CLAIM_STRIPES lock files per kernel): on one host the ranks of a job meet the same keys at about the same time, and
the ones behind wait and launch the first one's choice instead of timing configs of their own (which would differ by
rank). Locks are the operating system's (flock), released if their holder dies.

JAGGED_ATTENTION_TUNING_CACHE: a folder, or 0 for none; default Triton's cache folder (TRITON_CACHE_DIR,
~/.triton/cache) / jagged_attention_tuning. None is kept under the interpreter or with JAGGED_ATTENTION_AUTOTUNE=0 (one
config per kernel: nothing to choose). A stored config is launched without the pruner that cut the list by shared
memory: the identity's device name stands for that limit.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import inspect
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import triton

log = logging.getLogger(__name__)

# Keys share this many lock files per kernel identity: the folder stays bounded however many keys a run meets,
# and two keys of one stripe are tuned one after the other, which costs only when processes meet both at once.
CLAIM_STRIPES = 16


def default_folder() -> Path | None:
    setting = os.environ.get("JAGGED_ATTENTION_TUNING_CACHE")
    if setting == "0" or (setting is None and os.environ.get("TRITON_INTERPRET") == "1"):
        return None
    if setting:
        return Path(setting)
    return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache") / "jagged_attention_tuning"


def kernel_identity(tuner: triton.runtime.Autotuner, device_name: str) -> str:
    """`<kernel name>-<hash>`: what a stored choice is valid for."""
    fn = tuner.fn  # a JITFunction (its cache_key hashes its source and what it calls), or the interpreter's wrapper
    source = getattr(fn, "cache_key", None) or hashlib.sha256(inspect.getsource(fn.fn).encode()).hexdigest()
    parts = [source, triton.__version__, device_name, *(str(c) for c in tuner.configs)]
    return f"{fn.__name__}-{hashlib.sha256('|'.join(parts).encode()).hexdigest()[:24]}"


def claim_stripe(key: tuple) -> int:
    """Which of the identity's claim locks `key` takes: the same in every process (a digest, not hash())."""
    return int(hashlib.sha256(repr(key).encode()).hexdigest()[:8], 16) % CLAIM_STRIPES


class TuningStore:
    """Chosen configs per (kernel identity, tuning key) in `folder` (None: keeps nothing)."""

    def __init__(self, folder: Path | None):
        self.folder = folder
        self.loaded = 0  # choices taken from the store in this process

    def _path(self, identity: str) -> Path:
        return self.folder / f"{identity}.json"

    def _read(self, identity: str) -> dict[str, str]:
        path = self._path(identity)
        try:
            entries = json.loads(path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as error:  # unreadable: tune again, and the next put replaces it
            log.warning("jagged attention tuning store %s unreadable, ignored: %s", path, error)
            return {}
        return entries if isinstance(entries, dict) else {}

    def get(self, identity: str, key: tuple, configs: list[triton.Config]) -> triton.Config | None:
        """The config stored for `key` if it is one of `configs` (the kernel's list); else None."""
        if self.folder is None:
            return None
        stored = self._read(identity).get(repr(key))
        config = next((c for c in configs if str(c) == stored), None)
        self.loaded += config is not None
        return config

    @contextlib.contextmanager
    def claim(self, identity: str, key: tuple) -> Iterator[None]:
        """Held while this process tunes `key`: a process on the host that needs the same key meanwhile (another
        rank of the job) waits, then finds the choice in the store, so the ranks run the same kernels."""
        with contextlib.ExitStack() as held:
            if self.folder is not None:
                try:
                    held.enter_context(self._locked(f"{identity}-claim{claim_stripe(key)}"))
                except OSError as error:  # no lock (a read-only folder): tune alone, as without a store
                    log.warning("jagged attention tuning store %s: no lock taken: %s", self.folder, error)
            yield

    @contextlib.contextmanager
    def _locked(self, name: str) -> Iterator[None]:
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / f"{name}.lock", "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def put(self, identity: str, key: tuple, config: triton.Config) -> None:
        if self.folder is None:
            return
        try:
            with self._locked(identity):  # another process adding a key between this read and write would lose it
                entries = {**self._read(identity), repr(key): str(config)}
                with tempfile.NamedTemporaryFile("w", dir=self.folder, suffix=".tmp", delete=False) as aside:
                    json.dump(entries, aside, indent=1, sort_keys=True)
                os.replace(aside.name, self._path(identity))
        except OSError as error:  # a read-only or full disk costs later runs a tuning, not this one its step
            log.warning("jagged attention tuning store %s not written: %s", self.folder, error)
