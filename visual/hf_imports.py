"""Import-time work of transformers that a server process does not need.

transformers 5.x writes the docstring of every class decorated with `@auto_docstring` when its module is imported,
config classes included, and to do so imports its whole modeling and generation stack (torch.distributed, dynamo,
sympy, scipy, sklearn...). The router only reads a config, yet paid 7-8 s of start-up on a fresh machine for it
(transformers 5.17, measured with py-spy), and each image-preprocessing worker paid it for an image processor.
Only the generated docstrings are skipped: nothing a process reads. (Here, at the bottom of the import flow, so that
the visual process's workers can use it as well as the server's children.)
"""

from __future__ import annotations

import importlib


def _unchanged(obj, *args, **kwargs):
    return obj


def skip_docstring_generation() -> None:
    """For this process: classes and methods decorated with transformers' `auto_docstring` keep their docstrings."""
    try:  # the module (transformers.utils re-exports a function of the same name)
        module = importlib.import_module("transformers.utils.auto_docstring")
    except ImportError:  # a transformers without it: nothing to skip
        return
    for name in ("auto_class_docstring", "auto_method_docstring"):  # looked up when a decorator runs
        if hasattr(module, name):
            setattr(module, name, _unchanged)
