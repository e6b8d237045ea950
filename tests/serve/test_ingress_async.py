"""Every route of the ingress, and every dependency of one, is async: FastAPI runs a plain function in a thread pool,
and anyio's bookkeeping for each such hop walks every task of the event loop. With thousands of parked
``retrieve_future`` long-polls that walk took a third of the ingress's CPU (a py-spy profile under bench_load)."""

import inspect

from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute

from serve.app import api


def api_routes(router) -> list[APIRoute]:
    """Every API route, also those under an included router (which FastAPI keeps as a node of its own)."""
    found = []
    for route in router.routes:
        if isinstance(route, APIRoute):
            found.append(route)
        elif hasattr(route, "original_router"):
            found += api_routes(route.original_router)
    return found


def calls_of(dependant: Dependant) -> list:
    return [dependant.call] + [call for sub in dependant.dependencies for call in calls_of(sub)]


def test_no_route_or_dependency_of_the_ingress_runs_in_a_thread_pool():
    routes = api_routes(api)
    assert len(routes) > 20
    sync = [f"{route.path}: {call.__name__}" for route in routes for call in calls_of(route.dependant)
            if not inspect.iscoroutinefunction(call)]
    assert sync == []
