"""The model families served here: one spec each, in one table (families/table.py). A bottom package: anything may
import it, and it imports nothing else of ours (the parts are named as "module:attr" and resolved on use)."""

from families.spec import FamilySpec, resolve
from families.table import FAMILIES, all_families, architectures, family, image_architectures, registered

__all__ = [
    "FAMILIES",
    "FamilySpec",
    "all_families",
    "architectures",
    "family",
    "image_architectures",
    "registered",
    "resolve",
]
