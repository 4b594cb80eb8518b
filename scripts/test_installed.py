#!/usr/bin/env python3
"""Run the test suite against the *installed* ampscale, not the source tree next to it.

Usage: python scripts/test_installed.py [pytest options]

Copies the suite and what it reads (tests/, conftest.py, pyproject.toml, README.md,
requirements-test.txt, docs/, scripts/, examples/, benchmarks/) into a temporary folder without
the ``ampscale/`` package, checks that ``import ampscale`` there finds an installed copy (a wheel,
an sdist install), prints what that copy can run (``python -m ampscale info``), and runs
``python -m pytest`` there with the given options. CI runs it on the package built from the
sdist; cibuildwheel runs it on each wheel. The exit status is pytest's.
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
COPIED = [
    "tests",
    "conftest.py",
    "pyproject.toml",
    "README.md",
    "requirements-test.txt",
    "docs",
    "examples",
    "benchmarks",
    "scripts",
]
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", ".hypothesis")


def main(args: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="ampscale-installed-") as folder:
        work = pathlib.Path(folder)
        for name in COPIED:
            source = ROOT / name
            if source.is_dir():
                shutil.copytree(source, work / name, ignore=IGNORED)
            elif source.exists():
                shutil.copy2(source, work / name)
        where = subprocess.run(
            [sys.executable, "-c", "import ampscale; print(ampscale.__file__)"],
            cwd=work,
            capture_output=True,
            text=True,
        )
        if where.returncode != 0:
            print(f"ampscale is not installed for {sys.executable}:\n{where.stderr}", file=sys.stderr)
            return 2
        location = pathlib.Path(where.stdout.strip()).resolve()
        if work.resolve() in location.parents or ROOT in location.parents:
            print(f"ampscale imports from {location}, not from an installed copy", file=sys.stderr)
            return 2
        print(f"testing the installed ampscale at {location.parent}", flush=True)
        subprocess.run([sys.executable, "-m", "ampscale", "info"], cwd=work, check=True)
        # the package's own doctests run from the source tree; here only the suite runs
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "tests", *args]
        return subprocess.run(command, cwd=work).returncode


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
