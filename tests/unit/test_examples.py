"""The example clients as a newcomer meets them: `--help` opens with the script's whole description (its docstring's
first paragraph, not a line of it), and every client defaults to the address the README's quick-start command
serves on, as do the server commands and URLs in its docstring."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = sorted(name for name in os.listdir(os.path.join(ROOT, "examples")) if name.endswith(".py"))


def readme_port() -> str:
    """The port of the README's quick-start command (`python -m mmserve.api_server ... --port N`)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    return re.search(r"python -m mmserve\.api_server [^\n]*--port (\d+)", readme).group(1)


def docstring(name: str) -> str:
    with open(os.path.join(ROOT, "examples", name)) as f:
        return ast.get_docstring(ast.parse(f.read()))


def words(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("name", EXAMPLES)
def test_help_reads_whole_and_defaults_to_the_readme_port(name):
    run = subprocess.run([sys.executable, os.path.join(ROOT, "examples", name), "--help"], capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert run.returncode == 0, run.stderr
    description = words(docstring(name).split("\n\n")[0])
    assert description.endswith("."), description
    assert description in words(run.stdout), run.stdout

    port = readme_port()
    defaults = re.findall(r"default: (?:http://[\w.]+:(\d+)|(\d+)\))", words(run.stdout))  # a URL's port or a port
    assert defaults and {a or b for a, b in defaults} == {port}, run.stdout
    in_docstring = re.findall(r"--port (\d+)|127\.0\.0\.1:(\d+)", docstring(name))
    assert {a or b for a, b in in_docstring} <= {port}, docstring(name)
    for line in docstring(name).splitlines():
        if "mmserve.api_server" in line:
            assert f"--port {port}" in line, line
