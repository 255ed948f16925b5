"""Server plumbing shared by the router and the workers: SSE, JSON and early-head responses, body limits, the
internal endpoints' shared secret, graceful shutdown, the collector's settings and fire-and-forget tasks."""
