"""Unit tests of visual/."""
