"""Runs test files' `on_cpu_interpreter` cases in fresh processes under the Triton interpreter:
TRITON_INTERPRET must be set before Triton is imported, so the default run cannot switch it on.

The files whose `test_interpreter_cases` a session runs share one interpreter run (tests/conftest.py): torch and
Triton start once rather than once per file. Its first process starts with the session, at low priority: the
interpreter is single-threaded Python, and most of the suite leaves one of a 2-core machine's cores idle. If that
process has not finished when a test asks for the outcomes, a second one takes the cases from the end of the list
until the two meet. Loaded with `-p tests.triton_interpreter`, this module is also the plugin that does the taking
and records how each case ended."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CLAIMS = "GEM_INTERPRETER_CLAIMS"  # a folder where a process claims each case before it runs it
FROM_END = "GEM_INTERPRETER_FROM_END"  # set: the process takes the cases from the last one back
REPORT = "GEM_INTERPRETER_REPORT"  # the file the process writes its cases' outcomes to, a JSON object a line
TIMEOUT_S = 480
BACKGROUND_NICENESS = 19  # the first process takes only the CPU time the rest of the session leaves


def run_interpreter_cases(test_file: str, expected_passed: int, markers: str | None = None) -> None:
    """`markers`: the run's -m expression (None: the project's default, which leaves out the `slow` cases)."""
    selection = [] if markers is None else ["-m", markers]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", _relative(test_file), "-q",
         "-p", "no:cacheprovider", "-k", "on_cpu_interpreter", *selection],
        cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert f"{expected_passed} passed" in result.stdout, result.stdout[-2000:]


class InterpreterRuns:
    """How each case of the files ended, read back from the processes' reports."""

    def __init__(self, reports: list[dict], logs: list[str]):
        self.reports, self.logs = reports, logs

    def check(self, test_file: str, expected_passed: int) -> None:
        """The file's cases in the default run (`slow` left out): none failed, `expected_passed` passed."""
        name = _relative(test_file)
        mine = [r for r in self.reports if r["nodeid"].split("::")[0] == name]
        failed = {r["nodeid"]: r["text"] for r in mine if r["outcome"] == "failed"}
        passed = {r["nodeid"] for r in mine if r["when"] == "call" and r["outcome"] == "passed" and not r["xfail"]}
        tails = "\n".join(log[-2000:] for log in self.logs)
        assert not failed, "\n\n".join(f"{nodeid}:\n{text[-3000:]}" for nodeid, text in failed.items())
        assert len(passed - set(failed)) == expected_passed, \
            f"{len(passed)} of {name}'s interpreter cases passed, not {expected_passed}:\n{tails}"


class InterpreterRun:
    """The `on_cpu_interpreter` cases of `test_files`, in up to two processes: the first from the start of the list,
    a second from its end."""

    def __init__(self, test_files: list[str]):
        self.files = [_relative(f) for f in test_files]
        self.folder = Path(tempfile.mkdtemp(prefix="interpreter-"))
        (self.folder / "claims").mkdir()
        self.processes: list[tuple[subprocess.Popen, Path, object]] = []

    def start(self, niceness: int = 0) -> InterpreterRun:
        k = len(self.processes)
        report, log = self.folder / f"{k}.jsonl", open(self.folder / f"{k}.log", "w+")
        command = [sys.executable, "-m", "pytest", *self.files, "-q", "-p", "no:cacheprovider",
                   "-p", "tests.triton_interpreter", "-k", "on_cpu_interpreter", "--continue-on-collection-errors",
                   "--basetemp", str(self.folder / f"tmp{k}")]
        env = {**os.environ, "TRITON_INTERPRET": "1", CLAIMS: str(self.folder / "claims"), REPORT: str(report)}
        env |= {FROM_END: "1"} if k else {}
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        if niceness:
            os.setpriority(os.PRIO_PROCESS, proc.pid, niceness)
        self.processes.append((proc, report, log))
        return self

    def outcomes(self) -> InterpreterRuns:
        """Waits for the cases to end (helped by a second process if the first is still at it)."""
        if len(self.processes) == 1 and self.processes[0][0].poll() is None:
            self.start()
        try:
            for proc, _, _ in self.processes:
                proc.wait(timeout=TIMEOUT_S)
            reports, logs = [], []
            for proc, report, log in self.processes:
                log.seek(0)
                logs.append(f"exit code {proc.returncode}:\n{log.read()}")
                if report.exists():
                    reports += [json.loads(line) for line in report.read_text().splitlines()]
            return InterpreterRuns(reports, logs)
        finally:
            self.stop()

    def stop(self) -> None:
        for proc, _, log in self.processes:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def _relative(test_file: str | os.PathLike) -> str:
    return str(Path(test_file).resolve().relative_to(ROOT))


def _record(nodeid: str, when: str, outcome: str, xfail: bool, text: str) -> None:
    with open(os.environ[REPORT], "a") as report:
        report.write(json.dumps({"nodeid": nodeid, "when": when, "outcome": outcome, "xfail": xfail,
                                 "text": text}) + "\n")


# The plugin's hooks: pytest calls them only in a process that loads this module with -p.

@pytest.hookimpl(trylast=True)  # after -k and -m have deselected theirs
def pytest_collection_modifyitems(items):
    if os.environ.get(FROM_END):
        items.reverse()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item):
    if CLAIMS not in os.environ:
        return None
    try:
        os.close(os.open(Path(os.environ[CLAIMS]) / hashlib.sha256(item.nodeid.encode()).hexdigest(),
                         os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:  # the process coming from the other end got here first: the rest is its
        item.session.shouldstop = "the other interpreter process runs the remaining cases"
        return True
    return None


def pytest_runtest_logreport(report):
    if REPORT in os.environ:
        _record(report.nodeid, report.when, report.outcome, hasattr(report, "wasxfail"),
                report.longreprtext if report.failed else "")


def pytest_collectreport(report):
    if REPORT in os.environ and report.failed:
        _record(report.nodeid.split("::")[0], "collect", "failed", False, report.longreprtext)
