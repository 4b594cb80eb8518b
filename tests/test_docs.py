"""The documentation tells the truth: its code runs as written and its tables match the code.

Every ```python block of README.md and docs/*.md runs alone, in a fresh interpreter, so a block
that leans on a name from an earlier block fails. A block that is meant to go on from the one
before starts with ``# (continued)`` and runs after it, as one program. A block runs where
what it imports is installed (and, for CuPy, where a GPU is usable); none is skipped for any
other reason.

Running is not enough: every block checks what it computes, so a block that runs but computes
the wrong thing fails. A ``print(...)`` line ending in a ``# comment`` must print that comment;
a ``# prints:`` line followed by comment lines must print those lines, in a row; an ``assert``
must hold. Only output that depends on the machine (a status line) is shown unchecked, after
``# prints, for example:``.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import html
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

from tests import presets_table

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]
CONTINUED = "# (continued)"


@dataclasses.dataclass(frozen=True)
class Block:
    """One code block, with the blocks it continues prepended."""

    page: str
    index: int
    code: str  # the program to run: earlier blocks it continues, then this one
    own: str  # this block's text alone

    @property
    def id(self) -> str:
        return f"{self.page}[{self.index}]"


def python_blocks(page: str, root: pathlib.Path = ROOT) -> list[Block]:
    """The page's ```python blocks, each joined with the ones it continues."""
    texts = re.findall(r"^```python\n(.*?)^```", (root / page).read_text(), flags=re.S | re.M)
    blocks: list[Block] = []
    for index, text in enumerate(texts):
        if text.startswith(CONTINUED):
            if not blocks:
                raise AssertionError(f"{page}: the first block cannot continue another")
            code = blocks[-1].code + "\n" + text
        else:
            code = text
        blocks.append(Block(page, index, code, text))
    return blocks


def run_block(block: Block) -> subprocess.CompletedProcess[str]:
    """Run the block's program in a new interpreter, at the repository root."""
    return subprocess.run([sys.executable, "-c", block.code], cwd=ROOT, capture_output=True, text=True, timeout=300)


ALL_BLOCKS = [block for page in PAGES for block in python_blocks(page)]


#: ampscale's modules named after a framework (ampscale.torch, ampscale.backends.jax, ...) need it
FRAMEWORKS = ("torch", "jax", "cupy")


def imported_modules(code: str) -> set[str]:
    """Top-level names of every module the code imports (the framework for ampscale's helpers)."""
    dotted = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            dotted.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            dotted.add(node.module)
            dotted.update(f"{node.module}.{alias.name}" for alias in node.names)
    names = {name.split(".")[0] for name in dotted}
    for name in dotted:
        if name.startswith("ampscale."):
            names.update(part for part in name.split(".") if part in FRAMEWORKS)
    return names


@functools.cache
def cupy_usable() -> bool:
    import ampscale

    return bool(ampscale.info(["cupy"])["backends"]["cupy"]["usable"])


def missing(code: str) -> str | None:
    """Why the block cannot run here (a module it imports, or a GPU), or None."""
    for name in sorted(imported_modules(code)):
        if importlib.util.find_spec(name) is None:
            return f"needs {name}, which is not installed"
    if "cupy" in imported_modules(code) and not cupy_usable():
        return "needs a usable CUDA GPU for CuPy"
    return None


def expected_prints(code: str) -> list[str]:
    """What the ``print(...)  # expected`` lines say they print, in order."""
    return [m.group(1).strip() for m in re.finditer(r"^[ \t]*print\(.*\)[ \t]+#[ \t]?(.*)$", code, flags=re.M)]


PRINTS = "# prints:"
EXAMPLE = "# prints, for example:"


def expected_outputs(code: str) -> list[list[str]]:
    """The output each ``# prints:`` line announces: the comment lines right after it."""
    outputs: list[list[str]] = []
    lines = code.splitlines()
    for index, line in enumerate(lines):
        if line.strip() != PRINTS:
            continue
        shown: list[str] = []
        for following in lines[index + 1 :]:
            if not following.lstrip().startswith("#"):
                break
            shown.append(following.lstrip()[1:].removeprefix(" ").rstrip())
        outputs.append(shown)
    return outputs


def checks(code: str) -> int:
    """How many results the code checks: print claims, announced outputs, asserts."""
    asserts = sum(isinstance(node, ast.Assert) for node in ast.walk(ast.parse(code)))
    return len(expected_prints(code)) + len(expected_outputs(code)) + asserts


def printed_in_a_row(expected: list[str], printed: list[str]) -> bool:
    """Whether ``expected`` appears in ``printed`` as consecutive lines."""
    return any(printed[i : i + len(expected)] == expected for i in range(len(printed) - len(expected) + 1))


def _param(block: Block) -> object:
    marks = [pytest.mark.gpu] if "cupy" in imported_modules(block.code) else []
    return pytest.param(block, id=block.id, marks=marks)


@pytest.mark.parametrize("block", [_param(b) for b in ALL_BLOCKS])
def test_every_code_block_runs_alone_in_a_fresh_interpreter(block: Block) -> None:
    reason = missing(block.code)
    if reason is not None:
        pytest.skip(reason)
    result = run_block(block)
    assert result.returncode == 0, f"{block.id} failed:\n{block.code}\n{result.stderr}"
    printed = [line.strip() for line in result.stdout.splitlines()]
    for claim in expected_prints(block.own):
        assert claim in printed, f"{block.id} says it prints {claim!r}; it printed {printed}"
    lines = [line.rstrip() for line in result.stdout.splitlines()]
    for output in expected_outputs(block.own):
        assert printed_in_a_row(output, lines), f"{block.id} says it prints {output}; it printed {lines}"


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id) for b in ALL_BLOCKS])
def test_every_code_block_checks_its_results(block: Block) -> None:
    """A block that only runs would pass while computing the wrong thing (the README's one-call
    block once unscaled its gradients twice, and ran)."""
    if EXAMPLE in block.own:
        assert PRINTS not in block.own, f"{block.id}: either checked output or an example, not both"
        return
    assert checks(block.own) > 0, (
        f"{block.id} checks nothing it computes: end a print(...) with '# <what it prints>', add "
        f"'{PRINTS}' and the output as comments, or an assert\n{block.own}"
    )


def test_the_block_rules_catch_what_they_claim_to(tmp_path) -> None:
    """On a made-up page: a block leaning on an earlier block's names fails alone, a marked
    continuation runs after its block, and the print claims and imports are read right."""
    (tmp_path / "page.md").write_text(
        "```python\nimport math\nx = 1\n```\n\ntext\n\n"
        "```python\n# (continued)\nprint(math.floor(x + 1.5))  # 2\n```\n\n"
        "```python\nprint(math.floor(x + 1.5))  # 2\n```\n"
    )
    first, continued, leaning = python_blocks("page.md", tmp_path)
    assert run_block(first).returncode == 0
    assert continued.code == "import math\nx = 1\n\n# (continued)\nprint(math.floor(x + 1.5))  # 2\n"
    assert run_block(continued).stdout == "2\n"
    assert "NameError" in run_block(leaning).stderr
    assert expected_prints(continued.own) == ["2"]
    assert expected_prints("print(x)\n# shown output, machine-dependent\n") == []  # a claim shares the line
    shown = "print('a')\nprint('  b')\n# prints:\n# a\n#   b\nx = 1\n# not output\n"
    assert expected_outputs(shown) == [["a", "  b"]]
    assert printed_in_a_row(["a", "  b"], ["x", "a", "  b"])
    assert not printed_in_a_row(["a", "  b"], ["a", "x", "  b"])
    assert checks(shown) == 1
    assert checks("x = 1\nassert x == 1\n") == 1
    assert checks("x = 1  # one\nprint(x)\n") == 0
    code = "import jax.numpy as jnp\nfrom cupy.cuda import nccl\nimport numpy"
    assert imported_modules(code) == {"jax", "cupy", "numpy"}
    assert imported_modules("import ampscale.torch") == {"ampscale", "torch"}
    assert imported_modules("from ampscale import jax") == {"ampscale", "jax"}
    assert imported_modules("import ampscale.backends.jax as jax_backend") == {"ampscale", "jax"}
    assert missing("import surely_not_a_module_ampscale_uses") is not None


def test_every_page_with_code_is_covered() -> None:
    pages_with_code = {block.page for block in ALL_BLOCKS}
    assert {"README.md", "docs/getting-started.md", "docs/backends.md", "docs/index.md"} <= pages_with_code


def test_no_block_is_a_fragment() -> None:
    """Fragments used to be skipped: every block is now a program, or continues one."""
    assert [b.id for b in ALL_BLOCKS if b.own.lstrip().startswith("# (fragment")] == []


def test_presets_table_matches_the_code() -> None:
    page = (ROOT / "docs" / "presets.md").read_text()
    for row in presets_table.rows():
        assert row in page, f"docs/presets.md is out of date; regenerate with tests/presets_table.py:\n{row}"


def test_files_the_docs_cite_exist() -> None:
    """Paths the docs name (``tests/...``, ``examples/...``, ``ampscale/...``) exist."""
    import ampscale

    pattern = r"`((?:tests|examples|benchmarks|ampscale|scripts)/[\w./-]+\.\w+)`"
    cited = {path for page in PAGES for path in re.findall(pattern, (ROOT / page).read_text())}
    assert cited, "the pattern finds the citations"
    installed = pathlib.Path(ampscale.__file__).parent.parent  # the source tree, or site-packages
    absent = [p for p in cited if not (installed if p.startswith("ampscale/") else ROOT).joinpath(p).exists()]
    assert sorted(absent) == []


@pytest.fixture(scope="session")
def site(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The docs site, built once as CI builds it (strict), where the docs tools are installed."""
    for module in ("mkdocs", "material", "mkdocstrings_handlers"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"the docs build needs {module} (pip install -e '.[docs]')")
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-5000:]
    return out


def page_text(site: pathlib.Path, page: str) -> str:
    """A built page's text, as a reader sees it (tags removed, entities decoded)."""
    return html.unescape(re.sub(r"<[^>]+>", "", (site / page / "index.html").read_text()))


def test_the_api_reference_shows_defaults_and_links_not_source_markup(site: pathlib.Path) -> None:
    page = (site / "api" / "index.html").read_text()
    text = page_text(site, "api")
    assert "_UNSET" not in text
    assert "_SCALER_SETTING" not in text
    roles = re.findall(r":(?:class|meth|func|attr|mod|data|exc|obj):`?\w", text)
    assert roles == [], f"Sphinx roles printed as text: {roles[:10]}"
    assert "init_scale=the preset's (torch: 2.0**16)" in text
    assert "axis_name=the scaler's axis_name" in text
    links = set(re.findall(r'class="autorefs autorefs-internal"[^>]*href="([^"]+)"', page))
    assert {"#ampscale.Scaler.unscale", "#ampscale.ScaleAtFloorError", "#ampscale.masked_add_"} <= links


def test_the_home_page_shows_the_demos_picture(site: pathlib.Path) -> None:
    """The home page promises "one picture": the demo's plot, committed and built into the site."""
    picture = ROOT / "docs" / "img" / "demo.png"
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert picture.stat().st_size < 250_000  # a page image, not a print-resolution file
    assert "](img/demo.png)" in (ROOT / "docs" / "index.md").read_text()
    home = (site / "index.html").read_text()
    assert re.search(r'<img[^>]+src="img/demo\.png"', home)
    assert (site / "img" / "demo.png").read_bytes() == picture.read_bytes()


def test_help_and_home_page_say_what_ampscale_does_and_the_design_page_keeps_the_patent() -> None:
    import ampscale
    from ampscale.__main__ import USAGE

    home = (ROOT / "docs" / "index.md").read_text()
    for name, text in (("help(ampscale)", ampscale.__doc__ or ""), ("--help", USAGE), ("docs/index.md", home)):
        opening = text.split("\n\n")[:2]
        assert "loss scaling" in " ".join(opening), f"{name} does not open with what ampscale does"
        assert "patent" not in text.lower(), f"{name} speaks of the patent; the design page does"
    design = (ROOT / "docs" / "design.md").read_text()
    interfaces = design.split("## The three interfaces", 1)[1].split("\n## ", 1)[0]
    assert "CN115018072A" in interfaces
    for call in ("ampscale.create_scaler(...)", "scaler.scale(loss)", "scaler.update(...)", "scaler.step(...)"):
        assert call in interfaces


#: the longest code line the docs show: it fits a normal window (and a 88-column editor)
CODE_WIDTH = 88
#: every page the site shows code from (the benchmarks page includes benchmarks/README.md)
CODE_PAGES = [*PAGES, "benchmarks/README.md"]


def long_code_lines(page: str, root: pathlib.Path = ROOT) -> list[str]:
    """``page:line (length)`` for each line of a fenced code block longer than ``CODE_WIDTH``."""
    text = (root / page).read_text()
    found = []
    for match in re.finditer(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M):
        first = text[: match.start(1)].count("\n") + 1
        for offset, line in enumerate(match.group(1).splitlines()):
            if len(line) > CODE_WIDTH:
                found.append(f"{page}:{first + offset} ({len(line)})")
    return found


def test_no_code_line_in_the_docs_is_clipped() -> None:
    assert [line for page in CODE_PAGES for line in long_code_lines(page)] == []


def test_the_width_rule_finds_long_lines(tmp_path: pathlib.Path) -> None:
    (tmp_path / "page.md").write_text("x" * 200 + "\n\n```bash\nok\n" + "y" * 89 + "\n```\n")
    assert long_code_lines("page.md", tmp_path) == ["page.md:5 (89)"]


def test_code_blocks_wrap_rather_than_clip_in_the_site(site: pathlib.Path) -> None:
    css = (ROOT / "docs" / "stylesheets" / "code.css").read_text()
    assert re.search(r"\.md-typeset pre > code \{[^}]*white-space: pre-wrap", css)
    assert 'href="stylesheets/code.css"' in (site / "index.html").read_text()


def test_the_benchmarks_page_opens_with_a_summary_and_the_chart_then_the_rows(site: pathlib.Path) -> None:
    page = (site / "benchmarks" / "index.html").read_text()
    article = page.split("<article", 1)[1]
    assert len(re.findall(r"<h1", article)) == 1
    toc = page.split('aria-label="Table of contents"', 1)[1].split("</nav>\n", 1)[0]
    entries = re.findall(r'href="#([\w-]+)"', toc)
    assert entries[:3] == ["summary", "how-it-is-measured", "cpu-the-projects-2-core-machine"], entries
    chart = article.find('src="../img/benchmarks.png"')
    rows = article.find('id="all-rows"')
    assert 0 < article.find('id="summary"') < chart < rows
    assert (site / "img" / "benchmarks.png").read_bytes() == (ROOT / "docs" / "img" / "benchmarks.png").read_bytes()


def test_the_readmes_test_command_names_libsimde_and_gives_cpu_times() -> None:
    section = (ROOT / "README.md").read_text().split("## Two commands", 1)[1].split("\n## ", 1)[0]
    assert "libsimde-dev" in section
    assert "AVX-512" in section.split("libsimde-dev", 1)[1]  # and what it adds
    skip_reason = (ROOT / "tests" / "test_native_kernels.py").read_text()
    assert "apt-get install libsimde-dev" in skip_reason  # the skips say so too
    table = [line for line in section.splitlines() if line.startswith("|")]
    assert table[0].rstrip(" |").endswith("CPU time of the run")
    for row in table[2:]:
        cpu_time = row.rstrip(" |").rsplit("|", 1)[1].strip()
        assert re.fullmatch(r"(\d+ min )?\d+ s", cpu_time), f"no CPU time measured: {row}"
