"""Micro-benchmarks of the server-side aggregation rules (run as ``python -m bench.<name>``)."""
