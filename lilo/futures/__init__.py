"""The futures store: every submitted request and its result, in SQLite, owned by one writer."""
