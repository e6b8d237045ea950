"""The Ray Serve application and the `lilo` command line, in parts by audience, each importing only those before
it: ``http`` (the plumbing every route shares), ``tinker`` (the Tinker API), ``openai`` and ``console`` (the
OpenAI-compatible endpoint and the web console), the composing modules ``app``, ``control`` and ``deploy``, and
``cli`` (the operator's command line). tests/serve/test_serve_layout.py holds them to it."""
