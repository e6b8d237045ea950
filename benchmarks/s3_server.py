"""An S3-compatible server on loopback for tests: moto's server, the test double Ray's own storage tests use (no
cloud is reachable here). lilo reaches it through pyarrow's real S3 client, as it would reach S3 or MinIO.

Its objects live in this process (moto's in-memory backend), so stopping the server and starting it again on the
same port is a real outage that loses nothing: an upload during it fails for real.
"""

from __future__ import annotations

import logging
import uuid

import pyarrow.fs as pafs
from moto.server import ThreadedMotoServer

# Its request log would fill every failing test's report.
logging.getLogger("werkzeug").setLevel(logging.WARNING)

# The credentials travel in the URI, so every process of a test cluster (trainers, ingress) has them.
ACCESS = "testing:testing"


class S3Server:
    """A moto S3 server on 127.0.0.1 and one bucket of its own."""

    def __init__(self) -> None:
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        self.port = self._server.get_host_and_port()[1]
        self.bucket = f"lilo-{uuid.uuid4().hex[:12]}"
        filesystem, _ = pafs.FileSystem.from_uri(self.uri("") + "&allow_bucket_creation=true")
        filesystem.create_dir(self.bucket)

    def uri(self, prefix: str = "lilo") -> str:
        """``s3://`` URI of ``prefix`` in the bucket, with what pyarrow needs to reach this server."""
        return (f"s3://{ACCESS}@{self.bucket}/{prefix}?region=us-east-1&scheme=http"
                f"&endpoint_override=127.0.0.1:{self.port}")

    def stop(self) -> None:
        self._server.stop()

    def restart(self) -> None:
        """Serve again on the same port (the objects are still there)."""
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()
