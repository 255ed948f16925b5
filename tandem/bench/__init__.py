"""`tandem bench`: a load generator for OpenAI-compatible servers that measures latency-throughput curves.

distributions (lengths, arrivals) -> prompts -> client (one timed streaming request) -> loadgen (sweeps)
-> summary (per point) -> report (JSON, CSV, analysis) -> plots (PNG). `command` ties them to the CLI.
"""
