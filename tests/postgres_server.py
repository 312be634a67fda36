"""A throwaway PostgreSQL server for tests: initdb into a fresh folder, postgres on 127.0.0.1, stopped by its PID.

PostgreSQL refuses to run as root; under root the server runs as the unprivileged `postgres` user that
Debian's package creates, in a folder that user owns.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.servers import free_port, start_server, stop_server

SUPERUSER = "postgres"
# SQLAlchemy 2.1 reads a bare postgresql:// with psycopg 3; the project pins psycopg2, so URLs name it.
URL_SCHEME = "postgresql+psycopg2"
INSTALL_HINT = "install PostgreSQL's server (Debian: `apt-get install postgresql`)"


def server_bin_dir() -> Path | None:
    """The folder with initdb and postgres: from PATH (initdb is often a link into the real folder, which
    holds postgres), else the newest /usr/lib/postgresql/<version>/bin."""
    candidates = []
    if shutil.which("initdb"):
        candidates.append(Path(os.path.realpath(shutil.which("initdb"))).parent)
    versions = glob.glob("/usr/lib/postgresql/*/bin")
    candidates += [Path(p) for p in sorted(versions, key=lambda p: int(Path(p).parent.name), reverse=True)
                   if Path(p).parent.name.isdigit()]
    return next((d for d in candidates if (d / "initdb").is_file() and (d / "postgres").is_file()), None)


def unprivileged_user() -> str | None:
    """Who runs the server: None (this process's user) unless that is root, then `postgres`."""
    return SUPERUSER if os.geteuid() == 0 else None


@dataclass(frozen=True)
class PostgresServer:
    host: str
    port: int

    def url(self, database: str) -> str:
        return f"{URL_SCHEME}://{SUPERUSER}@{self.host}:{self.port}/{database}"

    def connect(self, database: str = "postgres"):
        import psycopg2

        return psycopg2.connect(host=self.host, port=self.port, user=SUPERUSER, dbname=database, connect_timeout=2)

    def create_database(self, name: str) -> str:
        """A new empty database; returns its URL."""
        connection = self.connect()
        try:
            connection.autocommit = True  # CREATE DATABASE cannot run in a transaction
            with connection.cursor() as cursor:
                cursor.execute(f'CREATE DATABASE "{name}"')
        finally:
            connection.close()
        return self.url(name)

    def is_ready(self) -> bool:
        import psycopg2

        try:
            self.connect().close()
        except psycopg2.OperationalError:
            return False
        return True


@contextlib.contextmanager
def running_postgres(bin_dir: Path, timeout: float = 60.0) -> Iterator[PostgresServer]:
    """A fresh cluster (trust authentication, on 127.0.0.1 only) for the duration of the block; its folder is
    removed afterwards. fsync and synchronous commits are off: nothing here has to survive a crash."""
    user = unprivileged_user()
    as_user = {"user": user, "group": pwd.getpwnam(user).pw_gid, "extra_groups": []} if user else {}
    root = Path(tempfile.mkdtemp(prefix="gem-postgres-"))  # under /tmp, which any user can traverse
    try:
        if user:
            os.chown(root, pwd.getpwnam(user).pw_uid, pwd.getpwnam(user).pw_gid)
        data = root / "data"
        subprocess.run([str(bin_dir / "initdb"), "-D", str(data), "-U", SUPERUSER, "--auth=trust", "--no-sync",
                        "--encoding=UTF8", "--locale=C"], check=True, capture_output=True, cwd=root, **as_user)
        server = PostgresServer("127.0.0.1", free_port())
        command = [str(bin_dir / "postgres"), "-D", str(data), "-h", server.host, "-p", str(server.port),
                   "-k", str(root), "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"]
        proc = start_server(command, server.is_ready, timeout=timeout, cwd=root, **as_user)
        try:
            yield server
        finally:
            stop_server(proc, first=signal.SIGINT)  # SIGINT: PostgreSQL's fast shutdown
    finally:
        shutil.rmtree(root, ignore_errors=True)
