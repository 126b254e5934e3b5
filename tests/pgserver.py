"""A real PostgreSQL server for the tests: the system's binaries (Debian's ``postgresql`` package, which
``.ci/run`` installs when missing), a throwaway data directory, trust authentication on 127.0.0.1 and a
free port; stopped and deleted afterwards. As root, the server runs as the ``postgres`` system user (the
server refuses to run as root)."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def pg_bindir() -> Path:
    """Where initdb and pg_ctl live: on PATH, else Debian's /usr/lib/postgresql/<version>/bin."""
    found = shutil.which("initdb")
    if found:
        return Path(os.path.realpath(found)).parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    if not versions:
        raise RuntimeError("PostgreSQL's server binaries were not found: install them (Debian: apt-get install "
                           "postgresql; .ci/run does) to run the scale-out tests")
    return Path(versions[-1]).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def postgres_server(database: str = "medusa") -> Iterator[str]:
    """Start a server and yield a SQLAlchemy URL of a fresh database on it."""
    bindir = pg_bindir()
    root = Path(tempfile.mkdtemp(prefix="medusa-pg-"))
    data, port = root / "data", _free_port()
    user: list[str] = []
    if os.getuid() == 0:
        pw = pwd.getpwnam("postgres")
        os.chown(root, pw.pw_uid, pw.pw_gid)
        user = ["runuser", "-u", "postgres", "--"]

    def run(*cmd: str) -> None:
        proc = subprocess.run([*user, *cmd], capture_output=True, text=True, timeout=120)
        if proc.returncode:
            raise RuntimeError(f"{Path(cmd[0]).name} failed: {(proc.stderr or proc.stdout).strip()[-400:]}")

    try:
        run(str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust", "--no-sync", "-E", "UTF8")
        opts = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=100"
        run(str(bindir / "pg_ctl"), "-D", str(data), "-o", opts, "-l", str(root / "server.log"), "-w", "start")
        try:
            run(str(bindir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", database)
            yield f"postgresql://postgres@127.0.0.1:{port}/{database}"
        finally:
            run(str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop")
    finally:
        shutil.rmtree(root, ignore_errors=True)
