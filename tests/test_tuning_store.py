"""The attention kernels' tuning store (kernels/triton/tuning_store.py): a config chosen for a tuning key in one
process is launched by the next without timing the configs again, and only where it is still valid."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.triton_interpreter import ROOT, run_interpreter_cases

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
def test_interpreter_cases():
    run_interpreter_cases(__file__, expected_passed=3)


def _folder(setting: str | None, interpret: bool) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("JAGGED_ATTENTION_TUNING_CACHE", "TRITON_INTERPRET")}
    env.update({"TRITON_CACHE_DIR": "/tmp/triton-cache-for-test"}, **({"TRITON_INTERPRET": "1"} if interpret else {}))
    if setting is not None:
        env["JAGGED_ATTENTION_TUNING_CACHE"] = setting
    code = "from kernels.triton.tuning_store import default_folder; print(default_folder())"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


@pytest.mark.skipif(INTERPRETING, reason="runs outside the interpreter")
def test_the_store_folder_follows_its_setting():
    assert _folder(None, interpret=False) == "/tmp/triton-cache-for-test/jagged_attention_tuning"
    assert _folder("/data/tuning", interpret=False) == "/data/tuning"
    assert _folder("0", interpret=False) == "None"
    assert _folder(None, interpret=True) == "None"  # one config per kernel there
    assert _folder("/data/tuning", interpret=True) == "/data/tuning"


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
