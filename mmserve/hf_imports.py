"""Import-time work of transformers that a server process does not need.

transformers 5.x writes the docstring of every class decorated with `@auto_docstring` when its module is imported,
config classes included, and to do so imports its whole modeling and generation stack (torch.distributed, dynamo,
sympy, scipy, sklearn...). The router only reads a config, yet paid 7-8 s of start-up on a fresh machine for it
(transformers 5.17, measured with py-spy). Only the generated class docstrings are skipped: nothing a process reads.
"""

from __future__ import annotations

import importlib


def _unchanged(cls, custom_intro=None, custom_args=None, checkpoint=None):
    return cls


def skip_class_docstring_generation() -> None:
    """For this process: classes decorated with transformers' `auto_docstring` keep the docstring they have."""
    try:  # the module (transformers.utils re-exports a function of the same name)
        module = importlib.import_module("transformers.utils.auto_docstring")
    except ImportError:  # a transformers without it: nothing to skip
        return
    if hasattr(module, "auto_class_docstring"):
        module.auto_class_docstring = _unchanged
