"""Tandem's Kubernetes operator: one `LLMDeployment` becomes a prefill pool, a decode pool and a router.

The work is done by pure functions (`builders`, `sizing`, `validation`, `status`) that turn a spec into the
objects it needs and the observed objects into a status; `handlers` wires them into kopf, `kube` talks to
the API server, and `main.run_operator` starts it all (`tandem operator`).
"""
