"""Deploy the lilo Serve application onto the connected Ray cluster and wait until it answers."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from cluster.local import ClusterError
from lilo.settings import Settings
from serve.app import APP_NAME, build_application


def deploy(settings: Settings) -> None:
    """Start Serve on the configured host and start (re)deploying the lilo application, whose replica serves the
    configured port itself (``cluster.local.serve_env``); Serve's own proxy takes any free port. Returns before the
    replica runs (``wait_until_healthy`` waits for it), so that the caller can wait on the trainers meanwhile."""
    from ray import serve

    serve.start(http_options={"host": settings.http_host, "port": 0})
    serve.run_many([serve.RunTarget(build_application(settings), name=APP_NAME, route_prefix="/")],
                   wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)


def healthz(api_url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/api/v1/healthz", timeout=timeout_s) as response:
            return response.status == 200 and json.loads(response.read()) == {"status": "ok"}
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_until_healthy(api_url: str, timeout_s: float) -> None:
    """Return once the API answers at ``api_url``; raise ClusterError, with Serve's message, if the application's
    deploy failed (its replica's constructor raised, say), and TimeoutError if it did not answer in time."""
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    deadline = time.monotonic() + timeout_s
    while not healthz(api_url):
        app = serve.status().applications.get(APP_NAME)
        if app is not None and app.status == ApplicationStatus.DEPLOY_FAILED:
            raise ClusterError(f"The Serve application failed to deploy: {app.message}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{api_url}/api/v1/healthz did not answer within {timeout_s:.0f} s.")
        time.sleep(0.2)


def undeploy() -> None:
    """Remove Serve (controller, proxies, replicas) from the connected cluster."""
    from ray import serve

    serve.shutdown()
