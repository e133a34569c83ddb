"""Builders of small random-weight checkpoints in the published hub layouts, for tests, the demo server and the GPU
benchmarks (no model hub is reachable here, so these stand in for downloaded folders)."""
