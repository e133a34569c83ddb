"""Unit tests of cache/."""
