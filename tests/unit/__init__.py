"""Unit tests, one folder per package; the tests here are about the whole repository."""
