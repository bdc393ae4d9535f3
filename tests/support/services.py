"""Private Redis and PostgreSQL servers for the chaos tests, on free loopback ports in a temporary directory, so
restarting them never disturbs the shared servers other tests use."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import redis

from tests.support.cluster import free_port, wait_until


class PrivateRedis:
    """``redis-server`` on its own port. No persistence by default: a restart loses every message, the worst case
    (the deployment runs with an append-only file)."""

    def __init__(self, workdir: Path, *, appendonly: bool = False) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server is not installed")
        self.binary = binary
        self.workdir = workdir
        self.port = free_port()
        self.appendonly = appendonly
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes" if self.appendonly else "no", "--dir", str(self.workdir),
             "--maxmemory-policy", "noeviction"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        wait_until(lambda: redis.Redis(port=self.port, socket_connect_timeout=1).ping(), 20, "the private Redis")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=20)
        self.proc = None


def _pg_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


class PrivatePostgres:
    """A throw-away PostgreSQL cluster (initdb + pg_ctl) on its own port. As root, the server runs as the
    ``postgres`` system user (initdb refuses root)."""

    def __init__(self) -> None:
        bindir = _pg_bin()
        if bindir is None:
            raise FileNotFoundError("PostgreSQL's initdb/pg_ctl are not installed")
        self.bindir = bindir
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="infe_chaos_pg_"))
        self.data = self.dir / "data"
        self.log = self.dir / "server.log"
        self.as_user: list[str] = []
        if os.geteuid() == 0:
            if shutil.which("runuser") is None:
                raise PermissionError("running as root without runuser: cannot start a private PostgreSQL")
            import pwd

            try:
                user = pwd.getpwnam("postgres")
            except KeyError:
                raise PermissionError("running as root and there is no 'postgres' user to run PostgreSQL as") from None
            os.chown(self.dir, user.pw_uid, user.pw_gid)
            self.as_user = ["runuser", "-u", "postgres", "--"]
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")

    def _run(self, tool: str, *args: str) -> None:
        subprocess.run([*self.as_user, str(self.bindir / tool), *args], check=True, capture_output=True,
                       timeout=120)

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        options = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.log), "-w", "start")
        wait_until(self._ready, 30, "the private PostgreSQL")

    def _ready(self) -> bool:
        with psycopg.connect(f"postgresql://postgres@127.0.0.1:{self.port}/postgres", connect_timeout=2):
            return True

    def stop(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def private_postgres() -> Iterator[PrivatePostgres]:
    server = PrivatePostgres()
    try:
        server.start()
        yield server
    finally:
        server.remove()

