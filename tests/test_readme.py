"""The README and docs/*.md as written: each YAML block parses and is a valid run config of the job it is for (Dagster's
own validation against the code location's jobs), and each shell command is accepted by what runs it (make's
dry run of the target with its variables, the entry point's own argument parser, files it names exist).
Running them is left to the tests that run those entry points: `make test` is CI itself, `make pipeline`'s
run_local the slow end-to-end test, `make dagster`'s dagster dev and `make mlflow-ui`'s server the server
tests."""

import os
import re
import shlex
import subprocess
from pathlib import Path

import dagster as dg
import pytest
import yaml

from pipelines.definitions import defs

PROJECT = Path(__file__).resolve().parents[1]
README = PROJECT / "README.md"
GUIDES = "\n".join(path.read_text() for path in (README, *sorted((PROJECT / "docs").glob("*.md"))))
BLOCKS = re.findall(r"```yaml\n(.*?)```", GUIDES, flags=re.S)
SHELL = re.findall(r"```bash\n(.*?)```", GUIDES, flags=re.S)
ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")


def shell_commands() -> list[str]:
    """Every command line of the README's bash blocks: continuations joined, comments dropped."""
    commands = []
    for block in SHELL:
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                commands.extend(part.strip() for part in line.split("&&"))
    return commands


COMMANDS = shell_commands()


def _job_for(ops: dict) -> str:
    if "mfu_report" in ops:
        return "measure_mfu"
    return "prepare_data" if set(ops) <= {"raw_event_logs", "sequence_logs", "shuffled_batches"} else "gem_pipeline"


def test_the_readme_has_run_configs():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("block", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_every_readme_run_config_is_valid_for_its_job(block):
    config = yaml.safe_load(block)
    job = defs.resolve_job_def(_job_for(config["ops"]))
    assert dg.validate_run_config(job, config) is not None


def test_the_readme_has_shell_commands():
    assert any(c.startswith("make pipeline") for c in COMMANDS) and any(c.startswith("torchrun") for c in COMMANDS)


@pytest.mark.parametrize("command", COMMANDS, ids=[f"command{i}" for i in range(len(COMMANDS))])
def test_every_readme_shell_command_is_accepted_as_written(command, tmp_path):
    words = shlex.split(command)
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path)}
    while words and ASSIGNMENT.match(words[0]):  # VAR=value before the command
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    program, args = words[0], words[1:]
    if program in ("export", "createdb"):  # the shell's own, and PostgreSQL's client on the user's database
        assert program == "export" or all(re.fullmatch(r"\w+", a) for a in args)
        return
    if program == "make":
        dry = subprocess.run(["make", "-n", *args], cwd=PROJECT, env=env, capture_output=True, text=True)
        assert dry.returncode == 0, dry.stderr
        return
    if program == "torchrun":
        from torch.distributed.run import get_args_parser

        launched = get_args_parser().parse_args(args)
        assert launched.module and launched.training_script == "gem_ops.train"
        script_args = launched.training_script_args
        if "..." not in script_args:  # elided examples are checked up to their launcher
            _check_entry_point("gem_ops.train", script_args)
        return
    assert program.endswith("python") and args[0] == "-m", command
    _check_entry_point(args[1], args[2:])


def _check_entry_point(module: str, args: list[str]) -> None:
    import importlib

    parsed = importlib.import_module({"gem_ops.train": "gem_ops.train.__main__"}.get(module, module)).parse_args(args)
    for value in vars(parsed).values():  # a file the example names is in the project
        if isinstance(value, Path) and value.suffix in (".yaml", ".yml"):
            assert (PROJECT / value).is_file(), value


def expand_braces(pattern: str) -> list[str]:
    """`a_{b,c}.json` -> [a_b.json, a_c.json], nested left to right."""
    group = re.search(r"\{([^{}]*)\}", pattern)
    if group is None:
        return [pattern]
    return [name for choice in group.group(1).split(",")
            for name in expand_braces(pattern[:group.start()] + choice + pattern[group.end():])]


def test_every_result_file_the_guides_name_exists():
    """The READMEs quote figures by the result file they come from (often `name_{a,b}.json`): each must be there."""
    import fnmatch

    results = PROJECT / "benchmarks" / "results"
    stored = [path.name for path in results.iterdir()]
    text = GUIDES + (PROJECT / "benchmarks" / "README.md").read_text()
    named = {name.rsplit("/", 1)[-1] for quoted in re.findall(r"results/[\w.{},*\-]+\.(?:json|png|log)", text)
             for name in expand_braces(quoted)}
    assert len(named) > 50
    missing = sorted(name for name in named if not fnmatch.filter(stored, name))
    assert missing == [], f"named in the guides but not in {results}: {missing}"
