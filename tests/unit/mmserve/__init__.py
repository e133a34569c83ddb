"""Unit tests of mmserve/."""
