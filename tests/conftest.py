"""Fixtures shared by test modules: the gem_foundation_model asset trained on two days (an expensive
torchrun job through Dagster Pipes), which the GEM asset tests and the transfer asset tests both read; the Triton
interpreter's run of the kernel tests' CPU cases."""

import os

import pytest


@pytest.fixture(scope="session")
def gem_asset_runs(tmp_path_factory):
    # Imported here: the GPU machine runs the kernel tests without Dagster or MLflow installed.
    import dagster as dg
    from mlflow.tracking import MlflowClient

    from assets.gem_foundation_model import gem_foundation_model
    from assets.raw_event_logs import raw_event_logs
    from assets.resources import LakeResource, MLflowResource
    from assets.sequence_logs import sequence_logs
    from assets.shuffled_batches import shuffled_batches
    from tests.gem_asset_setup import DATA_CONFIG, DAYS, PROCESSES, TRAIN_CONFIG

    root = tmp_path_factory.mktemp("gem_asset")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    resources = {"lake": LakeResource(base_dir=str(root / "lake")),
                 "mlflow": MLflowResource(tracking_uri=uri, artifact_location=str(root / "artifacts")),
                 "pipes_subprocess_client": dg.PipesSubprocessClient(env={"OMP_NUM_THREADS": "1"})}
    (root / "dagster").mkdir()
    with dg.instance_for_test(temp_dir=str(root / "dagster")) as instance:
        for day in DAYS[:2]:
            assert dg.materialize([raw_event_logs], partition_key=day.isoformat(), resources=resources,
                                  instance=instance,
                                  run_config={"ops": {"raw_event_logs": DATA_CONFIG["raw_event_logs"]}}).success
        results = {}
        for day in DAYS[2:]:  # the second training day warm-starts from the first
            results[day] = dg.materialize(
                [raw_event_logs, sequence_logs, shuffled_batches, gem_foundation_model], partition_key=day.isoformat(),
                resources=resources, instance=instance,
                run_config={"ops": {**DATA_CONFIG, "gem_foundation_model": {
                    "config": {**TRAIN_CONFIG, "nproc_per_node": PROCESSES[day]}}}},
            )
        logs = {day: [e.message for e in instance.all_logs(r.run_id)] for day, r in results.items()}
        yield {"root": root, "results": results, "client": MlflowClient(uri), "uri": uri, "logs": logs,
               "resources": resources, "instance": instance}


INTERPRETER_RUN = pytest.StashKey()


def pytest_collection_finish(session):
    """The Triton interpreter's run of the `on_cpu_interpreter` cases of every file whose test_interpreter_cases
    this session runs starts now, in the background (tests/triton_interpreter.py)."""
    from tests.triton_interpreter import BACKGROUND_NICENESS, InterpreterRun

    files = sorted({str(item.path) for item in session.items
                    if getattr(item, "originalname", None) == "test_interpreter_cases"})
    if files and not session.config.option.collectonly and os.environ.get("TRITON_INTERPRET") != "1":
        session.config.stash[INTERPRETER_RUN] = InterpreterRun(files).start(BACKGROUND_NICENESS)


def pytest_sessionfinish(session):
    if INTERPRETER_RUN in session.config.stash:
        session.config.stash[INTERPRETER_RUN].stop()


@pytest.fixture(scope="session")
def interpreter_runs(request):
    """How the `on_cpu_interpreter` cases ended."""
    return request.config.stash[INTERPRETER_RUN].outcomes()


@pytest.fixture(scope="session", autouse=True)
def nothing_written_into_the_checkout():
    """MLflow puts the artifacts of an experiment created without an artifact location under ./mlruns: a test that
    does so writes into the checkout (and once had them committed). Every test gives its stores a temporary home."""
    from pathlib import Path

    stray = Path(__file__).resolve().parents[1] / "mlruns"
    existed = stray.exists()
    yield
    assert existed or not stray.exists(), f"a test wrote MLflow artifacts into the checkout: {stray}"
