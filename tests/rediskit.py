"""A live Redis server (Debian's ``redis-server``) on 127.0.0.1 for the redis tier's tests.

``RedisServer`` starts ``redis-server`` on a free port of 127.0.0.1 with a temporary working
directory and no persistence, waits for its "Ready to accept connections" line (no sleeps),
and stops it after. ``redis-server`` missing is a failure, not a skip: ``make test`` installs it
(``make redis``), and the redis tier must pass the same contract suite as the others.
"""

from __future__ import annotations

import itertools
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

_serial = itertools.count(1)
_READY = "Ready to accept connections"


class RedisServer:
    def __init__(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError(
                "redis-server is missing: the redis tier's tests need Debian's redis-server "
                "(run `make redis`, or `apt-get install redis-server` as root)"
            )
        self._dir = Path(tempfile.mkdtemp(prefix="kvwarm-redis-"))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        args = [exe, "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self._dir)]
        args += ["--save", "", "--appendonly", "no", "--daemonize", "no", "--logfile", ""]
        self._proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert self._proc.stdout is not None
        seen = []
        for line in self._proc.stdout:  # ends when the server exits
            seen.append(line)
            if _READY in line:
                break
        else:
            self.stop()
            raise RuntimeError("redis-server did not start:\n" + "".join(seen[-20:]))
        self.running = True

    def url(self, prefix: str | None = None, **options: str) -> str:
        """A URL for the tier: a fresh key prefix each call unless one is given."""
        prefix = prefix if prefix is not None else f"kvwarm-test-{next(_serial)}/"
        query = "&".join([f"prefix={prefix}"] + [f"{k}={v}" for k, v in options.items()])
        return f"redis://127.0.0.1:{self.port}/0?{query}"

    def stop(self) -> None:
        self.running = False
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        shutil.rmtree(self._dir, ignore_errors=True)
