"""The SDK's feature flags, as lilo answers ``client/config`` (once per client) and ``client/dynamic_config``
(re-read every ``refresh_interval_sec``): each flag on only where lilo implements what it switches on. Flags this
module does not name keep the SDK's defaults."""

from __future__ import annotations

import ipaddress
from typing import Any

DYNAMIC_REFRESH_S = 300


def client_config(client_host: str | None, compress_bodies: str) -> dict[str, Any]:
    """The flags for a client calling from ``client_host``.

    - ``pjwt_auth_enabled``: the SDK exchanges its key for a token (auth/token) and sends that; whoami reads it.
    - ``sample_use_retrieve_futures``: one poll per sampling client for all its samples (retrieve_futures).
    - ``sample_join_sampling_session``: an unpickled sampling client asks for its clone id (join_sampling_session).
    - ``custom_loss_server_side``: a custom loss is stored (create_custom_loss) and runs in the trainer's pass.
    - ``proto_compress_fwdbwd``: zstd forward_backward bodies, per ``compress_bodies`` (Settings): under "auto",
      asked only of clients on other machines.
    """
    return {"pjwt_auth_enabled": True, "sample_use_retrieve_futures": True, "sample_join_sampling_session": True,
            "custom_loss_server_side": True, "proto_compress_fwdbwd": _compresses(client_host, compress_bodies)}


def dynamic_config() -> dict[str, Any]:
    """``sample_cancel_enabled``: an abandoned sample is cancelled (cancel_future), out of its trainer's queue or
    stopped at its next token."""
    return {"refresh_interval_sec": DYNAMIC_REFRESH_S, "sample_cancel_enabled": True,
            "sample_cancel_max_batch_size": 64}


def _compresses(client_host: str | None, compress_bodies: str) -> bool:
    if compress_bodies != "auto":
        return compress_bodies == "always"
    try:
        return not ipaddress.ip_address(client_host or "").is_loopback
    except ValueError:  # no address (a test client) or a socket path: not another machine
        return False
