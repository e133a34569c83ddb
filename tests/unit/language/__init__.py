"""Unit tests of language/ (the engine, driven in-process)."""
