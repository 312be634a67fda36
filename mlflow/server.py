"""Starts the MLflow tracking server (UI and REST API) on the project's store.

    python mlflow/server.py [--host 127.0.0.1] [--port 5000] [--backend-store-uri URI]
                            [--artifact-root URI] [any other `mlflow server` option]

Defaults: the SQLite store mlflow/mlflow.db and the artifact folder mlflow/artifacts, the same
places the pipeline logs into without a server, so the UI shows those runs and their artifacts.
GEM_MLFLOW_BACKEND_URI (e.g. a postgresql:// URI) and GEM_MLFLOW_ARTIFACT_ROOT override them.

This script imports no mlflow: run as a script, this folder is first on sys.path. It replaces
itself with `mlflow server` (exec), so the PID its caller holds is the server's.
"""

import argparse
import os
import sys
from pathlib import Path
from urllib.parse import urlparse

TRACKING_DIR = Path(__file__).resolve().parent


def _as_uri_if_local(location: str) -> str:
    scheme = urlparse(location).scheme
    if scheme in ("", "file"):
        path = location.removeprefix("file://") if scheme else location
        return Path(path).resolve().as_uri()
    return location


def server_command(argv: list[str]) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=5000)
    parser.add_argument(
        "--backend-store-uri",
        default=os.environ.get("GEM_MLFLOW_BACKEND_URI") or f"sqlite:///{TRACKING_DIR / 'mlflow.db'}",
    )
    parser.add_argument(
        "--artifact-root",
        default=os.environ.get("GEM_MLFLOW_ARTIFACT_ROOT") or str(TRACKING_DIR / "artifacts"),
        help="where artifacts of experiments created through this server go",
    )
    args, passthrough = parser.parse_known_args(argv)

    artifact_root = _as_uri_if_local(args.artifact_root)
    storage = ["--artifacts-destination", artifact_root]
    if artifact_root.startswith("file:"):
        # A local root is recorded as it is, like the runs logged without a server: both kinds of
        # client then read and write the same folder. A remote root is proxied by the server.
        storage += ["--default-artifact-root", artifact_root]

    # -P keeps the working directory off sys.path, so a project folder named mlflow never shadows
    # the library. One worker and no job executor: the defaults take 3.6 GiB instead of ~640 MiB.
    return [
        sys.executable, "-P", "-m", "mlflow", "server",
        "--host", args.host,
        "--port", str(args.port),
        "--backend-store-uri", args.backend_store_uri,
        *storage,
        "--workers", "1",
        *passthrough,  # last, so an explicit option wins
    ]


def main() -> None:
    os.environ.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
    command = server_command(sys.argv[1:])
    sys.stdout.flush()
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
