"""Imported by the preprocessing workers' fork server (`visual.preprocess.start_fork_server`) before it forks any
worker: what every worker needs, once for all of them. transformers' docstring generation is skipped first, as in
every server process (`visual/hf_imports.py`): it would import transformers' whole modeling stack."""

from visual.hf_imports import skip_docstring_generation

skip_docstring_generation()

import visual.preprocess  # noqa: E402, F401 - the workers' entry points
from visual.models.base import import_families  # noqa: E402

import_families()
