"""The console: a web page at ``/console``, served by the ingress itself (``routes``: the page and its static files,
no build step), that shows a tenant its models, their critical paths, the trainers, checkpoints and sessions, from
the one authenticated route ``GET /api/v1/console/overview`` (``overview``). docs/console.md says what it shows."""
