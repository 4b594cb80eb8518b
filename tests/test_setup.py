"""``setup.py``: a C extension that does not build is left out, but never silently.

The install must not fail for want of a compiler (ampscale runs without its extensions, slower),
so a failed build is not an error; it is a warning that names the extension, says what runs
without it and quotes the compiler's last lines. ``AMPSCALE_REQUIRE_NATIVE=1`` (CI) makes it an
error. Each case builds a copy of the sources with the NumPy extension broken on purpose.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NATIVE = ROOT / "ampscale" / "_native"

pytestmark = [
    pytest.mark.skipif(not (ROOT / "setup.py").exists(), reason="needs the source tree (an installed copy has none)"),
    pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler"),
]


def _broken_tree(tmp_path: pathlib.Path) -> pathlib.Path:
    """setup.py and the extensions' sources, ``_numpy.c`` replaced by one that cannot compile."""
    tree = tmp_path / "tree"
    for relative in ("cpu/kernels.h", "cuda/_driver.c"):
        target = tree / "ampscale" / "_native" / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(NATIVE / relative, target)
    (tree / "ampscale" / "_native" / "cpu" / "_numpy.c").write_text(
        '#error "ampscale test: this extension is broken on purpose"\n'
    )
    shutil.copy(ROOT / "setup.py", tree / "setup.py")
    return tree


def _build(tree: pathlib.Path, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if k != "AMPSCALE_REQUIRE_NATIVE"}
    environment.update(env)
    return subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
        cwd=tree,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard only
    )


def test_a_failed_build_is_a_warning_that_names_it_and_quotes_the_compiler(tmp_path: pathlib.Path) -> None:
    tree = _broken_tree(tmp_path)
    done = _build(tree)
    assert done.returncode == 0, done.stderr[-3000:]  # optional: the install goes on
    assert "WARNING: the C extension ampscale._native.cpu._numpy was not built" in done.stderr
    assert "pure-NumPy path" in done.stderr  # what runs without it
    warning = done.stderr[done.stderr.index("WARNING: the C extension ampscale._native.cpu._numpy") :]
    assert "this extension is broken on purpose" in warning  # the compiler's own words
    assert list((tree / "ampscale" / "_native" / "cuda").glob("_driver*.so"))  # the other one is built
    assert "ampscale._native.cuda._driver was not built" not in done.stderr


def test_ci_makes_a_failed_build_an_error(tmp_path: pathlib.Path) -> None:
    done = _build(_broken_tree(tmp_path), AMPSCALE_REQUIRE_NATIVE="1")
    assert done.returncode != 0
    assert "AMPSCALE_REQUIRE_NATIVE=1 and these extensions did not build: ampscale._native.cpu._numpy" in (
        done.stderr + done.stdout
    )
