"""``lilo up`` checks --storage before trainers save into it (cluster.service.check_storage), against an
S3-compatible server on loopback (benchmarks/s3_server.py)."""

import pytest

from benchmarks.s3_server import S3Server
from cluster.local import ClusterError
from cluster.ports import free_ports
from cluster.service import check_storage
from lilo.settings import Settings
from lilo.storage import Storage


def test_lilo_up_refuses_a_storage_it_cannot_write_naming_it_without_credentials(tmp_path):
    s3 = S3Server()
    try:
        (nobody,) = free_ports(1)  # nothing listens there
        uri = s3.uri("x").replace(f"127.0.0.1:{s3.port}", f"127.0.0.1:{nobody}")
        with pytest.raises(ClusterError, match=rf"in the storage s3://{s3.bucket}/x \(.*\); check that it is reachable"
                           ) as refused:
            check_storage(Settings(home=tmp_path, storage=uri), print)
        assert "testing" not in str(refused.value)
        check_storage(Settings(home=tmp_path, storage=s3.uri("x")), print)  # a storage that works passes
        assert Storage(s3.uri("x")).tree("") == {}  # and keeps nothing of the check
    finally:
        s3.stop()
