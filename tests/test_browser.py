"""The two UIs in a real, headless chromium: `dagster dev` lists a run of the local runner under gem_pipeline and
launches a materialization picked in its dialogs; GEM's `mlflow_run` link opens the MLflow run that registered
the model. Screenshots of every step go under the test's folder (`screenshots/`)."""

import contextlib
import re
import shutil
import sys
from pathlib import Path
from urllib.parse import urlparse

import dagster as dg
import pytest
from playwright.sync_api import Page, expect, sync_playwright

from assets.resources import MLflowResource
from gem_ops.tracking import tracking_client
from tests.gem_asset_setup import DATA_CONFIG, DAYS, MODEL_NAME, TRAIN_CONFIG
from tests.local_runs import local_gem_pipeline, run_local
from tests.servers import free_port, start_server, stop_server, until_ready

PROJECT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium")
GEM_DAY = DAYS[2].isoformat()
LAUNCHED_DAY = DAYS[3].isoformat()  # a partition no run has materialized yet
GEM_ASSETS = ["raw_event_logs", "sequence_logs", "shuffled_batches", "gem_foundation_model"]
RUN_TIMEOUT_MS = 240_000  # a run launched from the UI starts a process that imports the whole code location

pytestmark = [
    pytest.mark.server,
    pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium on PATH: apt-get install chromium "
                       "(`make test` installs it when run as root)"),
]


def test_dagster_and_mlflow_uis_in_a_browser(tmp_path):
    mlflow_url = f"http://127.0.0.1:{free_port()}"
    dagster_url = f"http://127.0.0.1:{free_port()}"
    shots = tmp_path / "screenshots"
    _create_stores(tmp_path)
    servers = []
    try:
        # Both servers come up while the runs they will show are recorded: each of the three spends most of its
        # time in a process importing its code.
        servers.append(_start_mlflow_server(tmp_path, mlflow_url))
        servers.append(_start_dagster_dev(tmp_path, dagster_url, mlflow_url))
        gem_run = _record_gem_run(tmp_path, mlflow_url)
        for server in servers:
            until_ready(server)
        with _browser(shots) as page:
            _find_run_under_job(page, dagster_url, gem_run.run_id, shots)
            _launch_from_ui(page, dagster_url, "raw_event_logs", LAUNCHED_DAY, shots)
            # While the launched run works, in a page of its own: GEM's run in MLflow.
            _open_mlflow_run_of_gem(page.context.new_page(), dagster_url, mlflow_url, _mlflow_run_id(gem_run), shots)
            _launched_run_succeeds(page, shots)
    finally:
        for server in servers:
            stop_server(server)


def _create_stores(home: Path) -> None:
    """The Dagster instance (configured as `make pipeline` copies it) and the MLflow store, created before any
    server opens them: two processes creating one SQLite schema at once can collide."""
    instance_config = (PROJECT / "pipelines" / "configs" / "dagster.yaml").read_text()
    # Without the newsletter dialog a fresh instance opens a second after the first page loads: it raced the
    # test's first clicks (one landed under it and was lost).
    (home / "dagster.yaml").write_text(instance_config + "nux:\n  enabled: false\n")
    dg.DagsterInstance.from_config(str(home)).dispose()
    tracking_client(_tracking_uri(home))  # MLflow's tables, as the pipeline's first step creates them


def _record_gem_run(home: Path, mlflow_url: str):
    """What `make pipeline` leaves behind, in small: raw events for the days before, then one gem_pipeline run
    of the day that trains and registers GEM; the links in its metadata point at `mlflow_url`."""
    mlflow = MLflowResource(tracking_uri=_tracking_uri(home), artifact_location=str(home / "artifacts"),
                            ui_url=mlflow_url)
    job = local_gem_pipeline(home / "lake", mlflow)
    raw_events = {"ops": {"raw_event_logs": DATA_CONFIG["raw_event_logs"]}}
    training = {"gem_foundation_model": {"config": {**TRAIN_CONFIG, "nproc_per_node": 1}}}
    with dg.DagsterInstance.from_config(str(home)) as instance:
        for day in DAYS[:2]:
            run_local(job, instance, day.isoformat(), ["raw_event_logs"], raw_events)
        return run_local(job, instance, GEM_DAY, GEM_ASSETS, {"ops": {**DATA_CONFIG, **training}})


def _tracking_uri(home: Path) -> str:
    return f"sqlite:///{home / 'mlflow.db'}"


def _mlflow_run_id(result) -> str:
    [gem] = [e for e in result.get_asset_materialization_events() if e.asset_key == dg.AssetKey("gem_foundation_model")]
    return gem.materialization.metadata["mlflow_run_id"].value


def _start_mlflow_server(home: Path, url: str):
    command = [sys.executable, str(PROJECT / "mlflow" / "server.py"), "--port", str(urlparse(url).port),
               "--backend-store-uri", _tracking_uri(home), "--artifact-root", str(home / "artifacts")]
    return start_server(command, f"{url}/health", timeout=120, wait=False)


def _start_dagster_dev(home: Path, url: str, mlflow_url: str):
    """`make dagster` on the test's instance, lake and MLflow store; run links in the metadata of the runs it
    launches point at the MLflow server at `mlflow_url`."""
    dagster = str(Path(sys.executable).with_name("dagster"))
    env = {"DAGSTER_HOME": str(home), "GEM_LAKE_DIR": str(home / "lake"), "MLFLOW_TRACKING_URI": _tracking_uri(home),
           "MLFLOW_UI_URL": mlflow_url}
    command = [dagster, "dev", "-w", str(PROJECT / "workspace.yaml"), "-h", "127.0.0.1", "-p", str(urlparse(url).port)]
    return start_server(command, f"{url}/server_info", env=env, timeout=180, wait=False)


@contextlib.contextmanager
def _browser(shots: Path):
    """A page in a headless chromium; on a failure, a screenshot of every open page first."""
    with sync_playwright() as playwright:
        # No sandbox and no GPU: CI containers run as root without either; /dev/shm is small there.
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True,
                                             args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        page = browser.new_context(viewport={"width": 1400, "height": 900}).new_page()
        try:
            yield page
        except Exception:
            for opened in page.context.pages:
                _screenshot(opened, shots, "failed")
            raise
        finally:
            browser.close()


def _screenshot(page: Page, folder: Path, name: str) -> None:
    folder.mkdir(exist_ok=True)
    path = folder / f"{len(list(folder.iterdir())) + 1:02d}_{name}.png"
    page.screenshot(path=path, full_page=True)
    print(f"screenshot: {path}")


def _find_run_under_job(page: Page, dagster_url: str, run_id: str, shots: Path) -> None:
    page.goto(f"{dagster_url}/jobs")
    page.get_by_role("link", name="gem_pipeline").click()  # its name also holds its icons' labels
    page.get_by_role("tab", name="Runs").click()
    expect(page.get_by_text(run_id[:8], exact=True)).to_be_visible()
    _screenshot(page, shots, "gem_pipeline_runs")


def _launch_from_ui(page: Page, dagster_url: str, asset: str, day: str, shots: Path) -> None:
    """Materialize… on the asset's page, the day typed into the partition picker, then the run's page."""
    page.goto(f"{dagster_url}/assets/{asset}")
    page.get_by_role("button", name="Materialize…").click()
    dialog = page.get_by_role("dialog")
    picker = dialog.get_by_placeholder("No matching partitions")
    picker.fill(day)
    picker.press("Enter")
    _screenshot(page, shots, "partition_picked")
    dialog.get_by_role("button", name="Launch 1 run").click()
    page.get_by_role("link", name="View", exact=True).click()  # in the "Launched run" toast
    expect(page).to_have_url(re.compile(r"/runs/[0-9a-f-]{36}$"))
    expect(page.get_by_text(f"partition: {day}").first).to_be_visible()


def _launched_run_succeeds(page: Page, shots: Path) -> None:
    """The launched run's page until the run ends; it must end in success."""
    ended = page.get_by_text(re.compile(r"^(Success|Failure|Canceled)$")).first
    expect(ended).to_be_visible(timeout=RUN_TIMEOUT_MS)
    _screenshot(page, shots, "launched_run")
    assert ended.inner_text() == "Success", f"the run launched from the UI ended in {ended.inner_text()}: {page.url}"


def _open_mlflow_run_of_gem(page: Page, dagster_url: str, mlflow_url: str, mlflow_run_id: str, shots: Path) -> None:
    """The latest materialization's `mlflow_run` link, as a person clicks it (it opens a new tab), to the MLflow
    run of the training, whose page names the model version it registered."""
    page.goto(f"{dagster_url}/assets/gem_foundation_model")
    page.get_by_placeholder("Filter metadata keys").fill("mlflow_run")
    row = page.get_by_role("row").filter(has=page.get_by_text("mlflow_run", exact=True))
    link = row.get_by_role("link", name=mlflow_url)  # the URL as text (an icon beside it links there too)
    expect(link).to_have_attribute("href", re.compile(rf"^{re.escape(mlflow_url)}/#/.*/runs/{mlflow_run_id}$"))
    _screenshot(page, shots, "gem_metadata")
    with page.context.expect_page() as opened:
        link.click()
    mlflow = opened.value
    expect(mlflow.get_by_text(f"gem_foundation_model [{GEM_DAY}]").first).to_be_visible(timeout=60_000)
    registered = mlflow.locator(f'a[href="#/models/{MODEL_NAME}/versions/1"]')
    expect(registered).to_have_text(re.compile(rf"{MODEL_NAME}\s*v1"), timeout=30_000)
    _screenshot(mlflow, shots, "mlflow_run")
