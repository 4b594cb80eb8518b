"""The documentation tells the truth: its code runs and its tables match the code."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import pathlib
import re

import pytest

from tests import presets_table

ROOT = pathlib.Path(__file__).resolve().parent.parent


def python_blocks(path: pathlib.Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def test_presets_table_matches_the_code() -> None:
    page = (ROOT / "docs" / "presets.md").read_text()
    for row in presets_table.rows():
        assert row in page, f"docs/presets.md is out of date; regenerate with tests/presets_table.py:\n{row}"


def test_readme_example_runs_and_prints_what_it_says() -> None:
    block = python_blocks(ROOT / "README.md")[0]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, "README.md", "exec"), {})
    printed = out.getvalue().strip()
    claimed = re.search(r"print\(.*\)\s+# (.*)", block).group(1)
    assert printed == claimed


def _runnable(block: str) -> bool:
    """Blocks run unless marked as fragments or needing a framework that is not installed."""
    if block.lstrip().startswith("# (fragment"):
        return False
    needs = [
        name
        for name in ("torch", "jax", "optax", "cupy", "mpi4py")
        if re.search(rf"^\s*(import|from) {name}\b", block, flags=re.M)
    ]
    return all(importlib.util.find_spec(name) is not None for name in needs) and "nccl" not in block


@pytest.mark.parametrize("page", ["getting-started.md", "index.md", "backends.md", "migration.md", "reliability.md"])
def test_doc_pages_examples_run(page: str) -> None:
    namespace: dict = {}
    for block in python_blocks(ROOT / "docs" / page):
        if not _runnable(block):
            continue
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(block, page, "exec"), namespace)
