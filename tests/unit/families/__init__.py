"""Unit tests of families/ (the one table)."""
