"""Deploy the lilo Serve application onto the connected Ray cluster and wait until it answers."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from lilo.settings import Settings
from serve.app import APP_NAME, build_application


def deploy(settings: Settings) -> None:
    """Start Serve on the configured host and (re)deploy the lilo application, whose replica serves the configured
    port itself (``cluster.local.serve_env``); Serve's own proxy takes any free port."""
    from ray import serve

    serve.start(http_options={"host": settings.http_host, "port": 0})
    serve.run(build_application(settings), name=APP_NAME, route_prefix="/", blocking=False)


def healthz(api_url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/api/v1/healthz", timeout=timeout_s) as response:
            return response.status == 200 and json.loads(response.read()) == {"status": "ok"}
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_until_healthy(api_url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not healthz(api_url):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{api_url}/api/v1/healthz did not answer within {timeout_s:.0f} s.")
        time.sleep(0.2)


def undeploy() -> None:
    """Remove Serve (controller, proxies, replicas) from the connected cluster."""
    from ray import serve

    serve.shutdown()
