"""The house's layers, enforced from the code's own imports (docs/design.md, "The layers").

Every module of the package belongs to one layer; a module imports only modules of its own layer
or of the layers below it, and the imports form no circle. Every import counts: at the top of a
module, inside a function (a lazy import), and under ``TYPE_CHECKING``. A new module must be
placed in a layer here before it can land, so that the next circle fails this test, not a review;
and it must be named in its layer's row of the design page's drawing, so that the drawing cannot
go stale without this test saying so.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

import ampscale  # imports no framework (tests/test_imports.py)

# the package that runs: the source tree's, or an installed copy (scripts/test_installed.py)
PACKAGE = pathlib.Path(ampscale.__file__).resolve().parent
ROOT = PACKAGE.parent

#: the layers, lowest first: (name, the modules in it; a name ending in ".*" takes a whole subpackage)
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "foundation",
        (
            "ampscale._errors",
            "ampscale._config",
            "ampscale._tree",
            "ampscale._after_import",
            "ampscale._version",
            "ampscale.fp8._config",
        ),
    ),
    ("state machine", ("ampscale._core", "ampscale.fp8._transition")),
    ("code generator", ("ampscale._codegen",)),
    (
        "host operations and checkpoints",
        (
            "ampscale._ops",
            "ampscale._state_dict",
            "ampscale.fp8._exact",
            "ampscale.fp8._ops",
            "ampscale.fp8._cast",
            "ampscale.fp8._block",
            "ampscale.fp8._amax",
            "ampscale.fp8._codegen",
            "ampscale.fp8._update",
            "ampscale.fp8._state_dict",
            "ampscale.fp8._pass",
        ),
    ),
    ("native code", ("ampscale._native", "ampscale._native.*")),
    ("adapter protocol", ("ampscale.backends._base",)),
    (
        "adapters",
        (
            "ampscale.backends.numpy",
            "ampscale.backends.torch",
            "ampscale.backends._torch_cpu",
            "ampscale.backends._torch_cuda",
            "ampscale.backends._torch_overlap",
            "ampscale.backends.jax",
            "ampscale.backends._jax_custom_call",
            "ampscale.backends._jax_xla",
            "ampscale.backends.cupy",
            "ampscale.backends.array_api",
        ),
    ),
    ("backend registry", ("ampscale.backends",)),
    (
        "FP8 fused pass",
        ("ampscale.fp8._fused", "ampscale.fp8._fused_torch", "ampscale.fp8._fused_jax", "ampscale.fp8._fused_cuda"),
    ),
    (
        "scaler",
        (
            "ampscale._scaler",
            "ampscale._in_place",
            "ampscale._functional",
            "ampscale.fp8._cuda",
            "ampscale.fp8._distributed",
            "ampscale.fp8._scaler",
            "ampscale.fp8._combined",
        ),
    ),
    ("diagnostics", ("ampscale._diagnostics",)),
    ("package", ("ampscale", "ampscale._info", "ampscale.fp8")),
    (
        "framework helpers",
        (
            "ampscale._torch_scaler",
            "ampscale._torch_sharded",
            "ampscale.torch",
            "ampscale.jax",
            "ampscale._jmp",
            "ampscale.fp8.torch",
            "ampscale.fp8.jax",
            "ampscale.demo",
            "ampscale.__main__",
        ),
    ),
]


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def layer_of(module: str) -> int:
    for index, (_, members) in enumerate(LAYERS):
        for member in members:
            if module == member or (member.endswith(".*") and module.startswith(member[:-1])):
                return index
    raise AssertionError(f"{module} is in no layer: place it in LAYERS (tests/test_layers.py) and docs/design.md")


def _resolve(importer: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The package's modules an import statement loads (a name imported from a package that is
    itself a module counts as that module)."""
    if isinstance(node, ast.Import):
        candidates = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = importer.split(".")
            if MODULES[importer].name != "__init__.py":
                package = package[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join([*package, base] if base else package)
        candidates = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
    found = set()
    for name in candidates:
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name and name != importer:
            found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, wherever in the module the import stands."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                targets |= _resolve(name, node)
        graph[name] = targets
    return graph


def test_every_module_is_in_a_layer() -> None:
    for module in MODULES:
        layer_of(module)


def test_each_layer_imports_only_itself_and_the_layers_below() -> None:
    upward = [
        f"{importer} ({LAYERS[layer_of(importer)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
        for importer, targets in sorted(import_graph().items())
        for target in sorted(targets)
        if layer_of(target) > layer_of(importer)
    ]
    assert upward == [], "imports that run up the layers:\n" + "\n".join(upward)


def test_the_imports_form_no_circle() -> None:
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state:
                circle = visit(target)
                if circle:
                    return circle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            circle = visit(module)
            assert circle is None, "an import circle: " + " -> ".join(circle)


# the design page sits beside the suite (the source tree, or the copy scripts/test_installed.py makes),
# not beside the package, which may be an installed copy with no docs next to it
DESIGN = pathlib.Path(__file__).resolve().parent.parent / "docs" / "design.md"


def drawn_rows() -> dict[str, str]:
    """The rows of the layers drawing in docs/design.md: layer name -> the text of its row.

    The drawing is the ``text`` block of the section "The layers"; a row starts with the layer's
    name one space in (where the name is too long for the column, its modules begin on the next
    line) and goes on over the lines indented further.
    """
    section = DESIGN.read_text().split("## The layers", 1)[1].split("\n## ", 1)[0]
    drawing = section.split("```text\n", 1)[1].split("```", 1)[0]
    names = [name for name, _ in LAYERS]
    rows: dict[str, str] = {}
    current = None
    for line in drawing.splitlines():
        starts = [name for name in names if re.match(rf" {re.escape(name)}( {{2,}}|$)", line)]
        if starts:
            current = starts[0]
            assert current not in rows, f"the layer {current!r} has two rows in docs/design.md"
            rows[current] = line[len(current) + 1 :]
        else:
            if current is None or not line.startswith("  "):
                raise AssertionError(f"a row of no layer in docs/design.md: {line!r}")
            rows[current] += " " + line
    return rows


def drawn_path(module: str) -> str:
    """How the drawing names a module: its file under ``ampscale/`` (``backends/torch.py``)."""
    return MODULES[module].relative_to(PACKAGE).as_posix()


def test_every_module_is_drawn_in_its_layers_row_of_the_design_page() -> None:
    rows = drawn_rows()
    assert list(rows) == [name for name, _ in reversed(LAYERS)], "the drawing's rows, top down, are the layers"
    missing = [
        f"{drawn_path(module)} ({LAYERS[layer_of(module)][0]})"
        for module in sorted(MODULES)
        if not re.search(rf"(?<![\w/.]){re.escape(drawn_path(module))}(?![\w/])", rows[LAYERS[layer_of(module)][0]])
    ]
    assert missing == [], "modules the layers drawing of docs/design.md leaves out of their row:\n" + "\n".join(missing)


@pytest.mark.parametrize(
    "source",
    [
        "import ampscale._scaler\n",
        "def f():\n    from ampscale import _scaler\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ampscale._scaler import Scaler\n",
    ],
)
def test_the_rule_sees_top_level_lazy_and_type_checking_imports(source: str, monkeypatch) -> None:
    """The check itself: an upward import of each kind, planted in the state machine, is found."""
    tree_source = MODULES["ampscale._core"].read_text() + "\n" + source
    original = pathlib.Path.read_text

    def read_text(self: pathlib.Path, *args: object, **kwargs: object) -> str:
        if self == MODULES["ampscale._core"]:
            return tree_source
        return original(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(pathlib.Path, "read_text", read_text)
    with pytest.raises(AssertionError, match=r"ampscale\._core \(state machine\) imports ampscale\._scaler \(scaler\)"):
        test_each_layer_imports_only_itself_and_the_layers_below()
