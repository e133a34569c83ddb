"""Decoder families; the family table (families/table.py) names the class serving each HF architecture."""
