"""A live S3-compatible server (moto) on 127.0.0.1 for the s3 tier's tests, and helpers.

``MotoServer`` runs moto's real HTTP server on a free port of 127.0.0.1 in a thread of the
test process (other processes reach it over HTTP like any S3 endpoint) and stops it after;
``MotoServer(own_process=True)`` runs it in a child process instead, so its Python does not
share the caller's GIL (benchmarks: a remote store's work is not the client's).
Credentials are dummies set in the environment, so the tier finds them through boto3's
normal chain, as it would in production.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from kvwarm.cache.tiers.s3 import S3Tier
from kvwarm.cache.tiers.s3client import S3Client
from kvwarm.cache.types import S3Config

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "kvwarm-test",
    "AWS_SECRET_ACCESS_KEY": "kvwarm-test",
    "AWS_DEFAULT_REGION": "us-east-1",
}
_serial = itertools.count(1)


@contextmanager
def aws_env() -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


#: The child of ``MotoServer(own_process=True)``: serves on a free port, prints it, and
#: stops when its stdin closes (so it never outlives the parent).
_CHILD = (
    "import sys\n"
    "from moto.server import ThreadedMotoServer\n"
    "s = ThreadedMotoServer(ip_address='127.0.0.1', port=0, verbose=False)\n"
    "s.start()\n"
    "print(s.get_host_and_port()[1], flush=True)\n"
    "sys.stdin.read()\n"
    "s.stop()\n"
)


class MotoServer:
    def __init__(self, *, own_process: bool = False) -> None:
        from moto.server import ThreadedMotoServer

        self._server: ThreadedMotoServer | None = None
        self._child: subprocess.Popen[str] | None = None
        if own_process:
            self._child = subprocess.Popen(
                [sys.executable, "-c", _CHILD],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert self._child.stdout is not None
            line = self._child.stdout.readline()
            if not line.strip().isdigit():
                self._child.kill()
                raise RuntimeError(f"moto's child process did not start: {line!r}")
            host, port = "127.0.0.1", int(line)
        else:
            self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            self._server.start()
            host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self.running = True

    @property
    def pid(self) -> int | None:
        """The server's own process (``own_process=True``), else None."""
        return None if self._child is None else self._child.pid

    def stop(self) -> None:
        if self.running:
            self.running = False
            if self._server is not None:
                self._server.stop()
            if self._child is not None:
                assert self._child.stdin is not None
                self._child.stdin.close()
                try:
                    self._child.wait(10)
                except subprocess.TimeoutExpired:
                    self._child.kill()
                    self._child.wait()

    def client(self) -> S3Client:
        import boto3

        client: S3Client = boto3.client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1", **_keys()
        )
        return client

    def new_bucket(self) -> str:
        name = f"kvwarm-test-{next(_serial)}"
        self.client().create_bucket(Bucket=name)  # type: ignore[attr-defined]
        return name

    def config(self, bucket: str, prefix: str = "rows/", **kw: float) -> S3Config:
        return S3Config(
            bucket=bucket,
            prefix=prefix,
            endpoint_url=self.endpoint,
            region="us-east-1",
            connect_timeout_s=kw.get("connect_timeout_s", 1.0),
            read_timeout_s=kw.get("read_timeout_s", 5.0),
            max_attempts=int(kw.get("max_attempts", 1)),
            down_for_s=kw.get("down_for_s", 30.0),
        )


def _keys() -> dict[str, str]:
    return {
        "aws_access_key_id": CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
    }


def object_names(tier: S3Tier) -> list[str]:
    """Every object under the tier's prefix (what a bucket listing shows a person)."""
    page: Mapping[str, object] = tier.wire.client.list_objects_v2(
        Bucket=tier.config.bucket, Prefix=tier.config.prefix
    )
    contents = page.get("Contents", [])
    assert isinstance(contents, list)
    return sorted(str(item["Key"]) for item in contents)
