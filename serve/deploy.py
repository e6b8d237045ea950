"""Deploy the lilo Serve application onto the connected Ray cluster and wait until it answers."""

from __future__ import annotations

import time

from cluster.local import ClusterError, healthz
from lilo.settings import Settings
from serve.app import APP_NAME, build_application

HEALTHZ_EVERY_S = 0.05
STATUS_EVERY_S = 2.0


def start(settings: Settings) -> None:
    """Start Serve (its controller, and its proxy on any free port) on the configured host, with no application."""
    from ray import serve

    serve.start(http_options={"host": settings.http_host, "port": 0})


def deploy(settings: Settings) -> None:
    """Start (re)deploying the lilo application, whose replica serves the configured port itself
    (``cluster.local.serve_env``), on Serve as ``start`` started it. Returns before the replica runs
    (``wait_until_healthy`` waits for it), so that the caller can wait on the trainers meanwhile."""
    from ray import serve

    serve.run_many([serve.RunTarget(build_application(settings), name=APP_NAME, route_prefix="/")],
                   wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)


def wait_until_healthy(api_url: str, timeout_s: float) -> None:
    """Return once the API answers at ``api_url``; raise ClusterError, with Serve's message, if the application's
    deploy failed (its replica's constructor raised, say), and TimeoutError if it did not answer in time."""
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    deadline = time.monotonic() + timeout_s
    status_due = time.monotonic() + STATUS_EVERY_S
    while not healthz(api_url):
        # Asking Serve costs seconds while the trainers load beside it (its first call most: measured 3 s), so the
        # port is polled often and Serve only every few seconds: the API is seen answering the moment it does.
        if time.monotonic() >= status_due:
            app = serve.status().applications.get(APP_NAME)
            if app is not None and app.status == ApplicationStatus.DEPLOY_FAILED:
                raise ClusterError(f"The Serve application failed to deploy: {app.message}")
            status_due = time.monotonic() + STATUS_EVERY_S
        if time.monotonic() > deadline:
            raise TimeoutError(f"{api_url}/api/v1/healthz did not answer within {timeout_s:.0f} s.")
        time.sleep(HEALTHZ_EVERY_S)


def undeploy() -> None:
    """Remove Serve (controller, proxies, replicas) from the connected cluster."""
    from ray import serve

    serve.shutdown()
