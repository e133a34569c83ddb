"""Tiny random-weight checkpoints (the demo server's too) and the harness that tests and benchmarks share."""
