"""The HTTP plumbing every audience shares: the API key gate, body limits, strict JSON, the error table, request spans
and the listening socket. It imports no other part of serve."""
