"""The attention kernels' tuning store (kernels/triton/tuning_store.py): a config chosen for a tuning key in one
process is launched by the next without timing the configs again, and only where it is still valid."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.triton_interpreter import ROOT

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
KERNELS = ("forward", "dq", "dkdv")


@pytest.fixture
def fresh_launches(tmp_path):
    """The launchers with nothing chosen in this process and a store in tmp_path; restored afterwards."""
    from kernels.triton import triton_jagged_attention as kernel
    from kernels.triton.tuning_store import TuningStore

    launches = dict(zip(KERNELS, (kernel._launch_forward, kernel._launch_dq, kernel._launch_dkdv)))
    saved = {name: (dict(launch.chosen), list(launch.tuner.configs)) for name, launch in launches.items()}
    saved_store = kernel._TunedLaunch.store
    kernel._TunedLaunch.store = TuningStore(tmp_path / "store")
    for launch in launches.values():
        launch.chosen.clear()
    yield launches
    kernel._TunedLaunch.store = saved_store
    for name, launch in launches.items():
        launch.chosen.clear()
        launch.chosen.update(saved[name][0])
        launch.tuner.configs[:] = saved[name][1]


def _step(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One self attention forward and backward (lengths no other case uses: keys of their own); (out, dq)."""
    from kernels.jagged_attention import jagged_attention

    torch.manual_seed(seed)
    offsets = torch.tensor([0, 9, 9, 30, 41])
    q, k, v = (torch.randn(41, 2, 16, requires_grad=True) for _ in range(3))
    out = jagged_attention(q, k, v, offsets, offsets, causal=True, activation="softmax", backend="triton")
    out.square().sum().backward()
    return out.detach(), q.grad


def _store_files(launch, folder: Path) -> dict:
    return {path.name: json.loads(path.read_text()) for path in folder.glob(f"{launch.tuner.fn.__name__}-*.json")}


@pytest.mark.skipif(not INTERPRETING, reason="runs inside the interpreter subprocess of test_interpreter_cases")
def test_a_stored_choice_is_launched_without_tuning_on_cpu_interpreter(fresh_launches, tmp_path):
    from kernels.triton import triton_jagged_attention as kernel
    from kernels.triton.triton_jagged_attention_configs import _KV_BLOCKS, _configs
    from kernels.triton.tuning_store import kernel_identity

    runs = kernel.tuning_runs()
    tuned_out, tuned_dq = _step()
    assert kernel.tuning_runs() == runs + 3  # a new key for each kernel
    folder = tmp_path / "store"
    for name, launch in fresh_launches.items():  # one file per kernel, the key and the config it chose
        (entries,) = _store_files(launch, folder).values()
        assert entries == {repr(key): str(config) for key, config in launch.chosen.items()}, name
    assert not list(folder.glob("*.tmp"))  # written aside, then renamed

    # A second forward config, stored as the choice for that key: the next process launches it, timing nothing.
    forward = fresh_launches["forward"]
    (key,) = forward.chosen
    other = _configs([(16, 16, 4, 1)], "BLOCK_M", "BLOCK_N", _KV_BLOCKS)[0]
    forward.tuner.configs.append(other)
    forward.store.put(kernel_identity(forward.tuner, "cpu"), key, other)
    for launch in fresh_launches.values():
        launch.chosen.clear()
    runs, loaded = kernel.tuning_runs(), kernel.stored_tunings_used()
    out, dq = _step()
    assert kernel.tuning_runs() == runs + 0
    assert kernel.stored_tunings_used() == loaded + 3  # the forward's new choice, dq's and dk/dv's first ones
    assert forward.chosen[key] is other
    assert kernel.chosen_configs()["forward"][repr(key)] == str(other)
    torch.testing.assert_close(out, tuned_out)  # another tiling, the same attention
    torch.testing.assert_close(dq, tuned_dq)


@pytest.mark.skipif(not INTERPRETING, reason="runs inside the interpreter subprocess of test_interpreter_cases")
def test_a_stale_or_unreadable_store_costs_a_tuning_not_a_wrong_config_on_cpu_interpreter(fresh_launches, tmp_path,
                                                                                          caplog):
    from kernels.triton import triton_jagged_attention as kernel
    from kernels.triton.triton_jagged_attention_configs import _KV_BLOCKS, _configs

    _step()
    folder = tmp_path / "store"
    forward, dq = fresh_launches["forward"], fresh_launches["dq"]
    (forward_file,) = _store_files(forward, folder)
    (dq_file,) = _store_files(dq, folder)
    # The forward's choice names a config no longer in its list; the dq kernel's file is cut short by a crash.
    entries = json.loads((folder / forward_file).read_text())
    stale = str(_configs([(16, 16, 8, 2)], "BLOCK_M", "BLOCK_N", _KV_BLOCKS)[0])
    (folder / forward_file).write_text(json.dumps({key: stale for key in entries}))
    (folder / dq_file).write_text('{"(16, 16')
    for launch in fresh_launches.values():
        launch.chosen.clear()
    runs, loaded = kernel.tuning_runs(), kernel.stored_tunings_used()
    _step()
    assert kernel.tuning_runs() == runs + 2  # forward and dq tuned again, dk/dv from its file
    assert kernel.stored_tunings_used() == loaded + 1
    assert "unreadable" in caplog.text and dq_file in caplog.text
    assert [str(c) for c in forward.chosen.values()] != [stale]
    assert json.loads((folder / dq_file).read_text()) == {repr(k): str(c) for k, c in dq.chosen.items()}


@pytest.mark.skipif(not INTERPRETING, reason="runs inside the interpreter subprocess of test_interpreter_cases")
def test_a_changed_kernel_list_or_device_starts_a_new_store_file_on_cpu_interpreter(fresh_launches):
    from kernels.triton.triton_jagged_attention_configs import _KV_BLOCKS, _configs
    from kernels.triton.tuning_store import kernel_identity

    tuner = fresh_launches["forward"].tuner
    before = kernel_identity(tuner, "NVIDIA H100 80GB HBM3")
    assert before.startswith("forward_kernel-")
    assert kernel_identity(tuner, "NVIDIA H200") != before
    tuner.configs.append(_configs([(16, 16, 4, 1)], "BLOCK_M", "BLOCK_N", _KV_BLOCKS)[0])
    assert kernel_identity(tuner, "NVIDIA H100 80GB HBM3") != before


@pytest.mark.skipif(INTERPRETING, reason="this is the interpreter run itself")
def test_interpreter_cases(interpreter_runs):
    interpreter_runs.check(__file__, expected_passed=3)


@pytest.mark.parametrize("setting, interpret, folder", [
    (None, False, "/tmp/triton-cache-for-test/jagged_attention_tuning"),
    ("/data/tuning", False, "/data/tuning"),
    ("0", False, None),
    (None, True, None),  # one config per kernel there
    ("/data/tuning", True, "/data/tuning"),
])
def test_the_store_folder_follows_its_setting(monkeypatch, setting, interpret, folder):
    from kernels.triton.tuning_store import default_folder

    monkeypatch.setenv("TRITON_CACHE_DIR", "/tmp/triton-cache-for-test")
    for name, value in (("JAGGED_ATTENTION_TUNING_CACHE", setting), ("TRITON_INTERPRET", "1" if interpret else None)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert default_folder() == (None if folder is None else Path(folder))


def test_the_claim_locks_stay_bounded_however_many_keys_are_tuned(tmp_path):
    """Each key's claim takes one of a kernel's CLAIM_STRIPES lock files, the same one in every process: a long run
    meeting many length buckets leaves a bounded folder, not one empty lock file per key."""
    from kernels.triton.tuning_store import CLAIM_STRIPES, TuningStore, claim_stripe

    store = TuningStore(tmp_path)
    keys = [(length, 128, "softmax") for length in range(200)]
    for key in keys:
        with store.claim("forward-abc", key):
            pass
    locks = sorted(p.name for p in tmp_path.iterdir())
    assert locks == sorted({f"forward-abc-claim{claim_stripe(k)}.lock" for k in keys}) and len(locks) == CLAIM_STRIPES
    assert claim_stripe(keys[7]) == claim_stripe((7, 128, "softmax"))  # a digest of the key, not Python's hash()


RANK_SCRIPT = """
import json, os, sys, time
from pathlib import Path
import torch
from kernels.jagged_attention import jagged_attention, stored_tunings_used, tuning_runs
from kernels.triton.tuning_store import TuningStore

put = TuningStore.put
def slow_put(self, *args):  # a tuning that takes a while: the other process arrives while it runs
    time.sleep(1.0)
    put(self, *args)
TuningStore.put = slow_put
go = Path(sys.argv[1])
go.with_name(f"ready-{os.getpid()}").touch()  # imported: what follows is the step alone
while not go.exists():
    time.sleep(0.005)
offsets = torch.tensor([0, 9, 9, 30, 41])
q, k, v = (torch.randn(41, 2, 16, requires_grad=True) for _ in range(3))
jagged_attention(q, k, v, offsets, offsets, causal=True, activation="softmax", backend="triton").sum().backward()
print(json.dumps({"tuned": tuning_runs(), "from_store": stored_tunings_used()}))
"""


@pytest.mark.skipif(INTERPRETING, reason="starts interpreter processes of its own")
def test_two_ranks_meeting_a_key_at_once_run_one_tuning(tmp_path):
    """Two processes on one host (the ranks of a job) reach the same new keys together: one tunes each key, the
    other waits for it and launches its choice."""
    go = tmp_path / "go"
    env = {**os.environ, "TRITON_INTERPRET": "1", "JAGGED_ATTENTION_TUNING_CACHE": str(tmp_path / "store")}
    ranks = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(go)], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    deadline = time.monotonic() + 240
    while len(list(tmp_path.glob("ready-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    go.touch()
    outputs = [rank.communicate(timeout=300) for rank in ranks]
    assert all(rank.returncode == 0 for rank in ranks), [err[-2000:] for _, err in outputs]
    counts = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    assert sum(c["tuned"] for c in counts) == 3, counts  # forward, dq, dk/dv: each tuned once on the host
    assert sum(c["from_store"] for c in counts) == 3, counts


GPU_SCRIPT = """
import json, sys, torch
from kernels.jagged_attention import chosen_configs, jagged_attention, stored_tunings_used, tuning_runs
torch.manual_seed(0)
lengths = torch.randint(1, 700, (64,))
offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).cuda()
q, k, v = (torch.randn(int(offsets[-1]), 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for _ in range(3))
jagged_attention(q, k, v, offsets, offsets, causal=True, activation="softmax", backend="triton").sum().backward()
print(json.dumps({"tuned": tuning_runs(), "from_store": stored_tunings_used(), "configs": chosen_configs()}))
"""


@pytest.mark.gpu
def test_a_second_process_launches_the_first_ones_configs_on_gpu(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    env = {**os.environ, "JAGGED_ATTENTION_TUNING_CACHE": str(tmp_path / "store")}

    def run() -> dict:
        result = subprocess.run([sys.executable, "-c", GPU_SCRIPT], cwd=ROOT, env=env, capture_output=True,
                                text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout.strip().splitlines()[-1])

    first, second = run(), run()
    assert first["tuned"] == 3 and first["from_store"] == 0
    assert second["tuned"] == 0 and second["from_store"] == 3
    assert second["configs"] == first["configs"]
