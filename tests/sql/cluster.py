"""A private PostgreSQL cluster for the tests: `initdb` in a temporary directory, `postgres` on
127.0.0.1 and a free port, stopped and removed after (as pytest-postgresql does). As root it
runs as the `postgres` user of Debian's package (the server refuses to run as root)."""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

# A role that logs in with a password over SCRAM-SHA-256 (the rest is trust).
SCRAM_USER = "scram_user"
SCRAM_PASSWORD = "s3cret-scram-pw"


def bindir() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                   key=lambda p: int(p.split("/")[4]) if p.split("/")[4].isdigit() else 0)
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Cluster:
    def __init__(self, bin: Path) -> None:
        self.bin = bin
        self.port = _free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="jukebox-pg-"))
        self.data = self.dir / "data"
        self.user = None if os.geteuid() else pwd.getpwnam("postgres")
        if self.user is not None:
            os.chown(self.dir, self.user.pw_uid, self.user.pw_gid)
        self.dir.chmod(0o755)

    def _as_owner(self, argv: list[str], **kw) -> subprocess.CompletedProcess[str]:
        if self.user is not None:
            argv = ["runuser", "-u", "postgres", "--", *argv]
        return subprocess.run(argv, capture_output=True, text=True, check=True, cwd=self.dir,
                              **kw)

    def init(self) -> None:
        self._as_owner([str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres",
                        "--auth=trust", "-E", "UTF8", "--locale=C.UTF-8", "--no-sync"])
        with open(self.data / "postgresql.conf", "a") as f:
            f.write(
                f"listen_addresses = '127.0.0.1'\nport = {self.port}\n"
                f"unix_socket_directories = '{self.dir}'\n"
                "max_prepared_transactions = 10\nfsync = off\nsynchronous_commit = off\n"
                "full_page_writes = off\nshared_buffers = 16MB\nmax_connections = 40\n"
                "password_encryption = 'scram-sha-256'\n"
            )
        # TLS offered (not required) with a throwaway certificate: the proxy's sslmode=prefer
        # takes it, and a test asks for it with sslmode=require.
        key, cert = self.dir / "server.key", self.dir / "server.crt"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                        str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=127.0.0.1"],
                       check=True, capture_output=True)
        key.chmod(0o600)
        if self.user is not None:
            for path in (key, cert):
                os.chown(path, self.user.pw_uid, self.user.pw_gid)
        with open(self.data / "postgresql.conf", "a") as f:
            f.write(f"ssl = on\nssl_cert_file = '{cert}'\nssl_key_file = '{key}'\n")
        (self.data / "pg_hba.conf").write_text(
            f"host all {SCRAM_USER} 127.0.0.1/32 scram-sha-256\n"
            "host all all 127.0.0.1/32 trust\nlocal all all trust\n"
        )
        self.start()
        self.psql(f"CREATE ROLE {SCRAM_USER} LOGIN SUPERUSER PASSWORD '{SCRAM_PASSWORD}'")

    def start(self) -> None:
        self._as_owner([str(self.bin / "pg_ctl"), "-D", str(self.data), "-l",
                        str(self.dir / "log"), "-w", "-t", "60", "start"])

    def stop(self, mode: str = "fast") -> None:
        self._as_owner([str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w",
                        "-t", "60", "stop"])

    def restart(self) -> None:
        self.stop()
        self.start()

    def url(self, db: str = "postgres", user: str = "postgres", password: str = "") -> str:
        auth = f"{user}:{password}" if password else user
        return f"postgresql://{auth}@127.0.0.1:{self.port}/{db}"

    def psql(self, sql: str, db: str = "postgres") -> str:
        out = subprocess.run(
            ["psql", "-X", "-q", "-At", "-v", "ON_ERROR_STOP=1", "-d", self.url(db), "-c", sql],
            capture_output=True, text=True, check=True,
        )
        return out.stdout.strip()

    def dump(self, db: str) -> str:
        """Schema and rows; without the random key newer pg_dumps put in \\restrict lines."""
        out = subprocess.run(
            [str(self.bin / "pg_dump"), "--no-owner", "-d", self.url(db)],
            capture_output=True, text=True, check=True,
        ).stdout
        return "\n".join(line for line in out.splitlines()
                         if not line.startswith(("\\restrict", "\\unrestrict")))

    def remove(self) -> None:
        """Stops the server at once (SIGQUIT to the postmaster: what `pg_ctl -m immediate`
        sends, without its polling) and removes the cluster."""
        with contextlib.suppress(OSError, ValueError, IndexError):
            pid = int((self.data / "postmaster.pid").read_text().split()[0])
            os.kill(pid, signal.SIGQUIT)
            # Gone, or a zombie its reaper (pid 1 here) has not collected yet. A backend slow
            # to take SIGQUIT holds the postmaster up to 5 s: past a second, the postmaster is
            # killed outright.
            deadline = time.monotonic() + 1
            while time.monotonic() < deadline:
                stat = Path(f"/proc/{pid}/stat").read_text()  # FileNotFoundError once reaped
                if stat.rpartition(")")[2].split()[0] == "Z":
                    break
                time.sleep(0.02)
            else:  # its backends see the postmaster die and exit by themselves
                os.kill(pid, signal.SIGKILL)
        # Its hundreds of megabytes (a database per test) go in the background: on a busy disk
        # that takes seconds nobody needs to wait for.
        subprocess.Popen(["rm", "-rf", "--", str(self.dir)], start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_for(check, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting")
        time.sleep(0.05)
