"""The Ray Serve application: the FastAPI ingress that speaks the Tinker API, and the `lilo` command line."""
