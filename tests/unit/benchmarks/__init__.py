"""Unit tests of the benchmark scripts' own logic (the only tests that import benchmarks/)."""
