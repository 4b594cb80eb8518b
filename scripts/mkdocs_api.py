"""A griffe extension for the API reference (``mkdocs.yml`` loads it): what the source cannot say.

- **Defaults.** A setting left out of ``create_scaler`` (and of the drop-ins' constructors)
  takes the preset's own default. In the source that is a sentinel (``_UNSET``), which
  ``help()`` shows as ``<preset default>``; the reference shows the value instead, as
  ``the preset's (torch: 2.0**16)``. A per-call ``axis_name`` left out is the scaler's setting.
- **Cross-references.** Docstrings name other objects with Sphinx roles (``:class:`Scaler```),
  which read well in ``help()``. Here each becomes a mkdocstrings link, resolved against the
  loaded package: relative to the object's class and module, then to ampscale's top level, and
  written with the object's public path (``ampscale.Scaler``, not ``ampscale._scaler.Scaler``).
  A name that is not ampscale's (``torch.amp.GradScaler``) stays code. ``mkdocs build --strict``
  fails on a link whose target the reference does not render.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import griffe

PACKAGE = "ampscale"
#: the modules users import, whose names are the objects' public paths
PUBLIC_MODULES = ("ampscale", "ampscale.torch", "ampscale.jax", "ampscale.backends.jax", "ampscale.fp8")
ROLE = re.compile(r":(?:class|meth|func|attr|mod|data|exc|obj):`(~?)([^`]+)`")
UNSET = "_UNSET"
SCALER_SETTING = "_SCALER_SETTING"
#: where a default left out is not the preset's: (function name, parameter) -> what it is
SPECIAL_DEFAULTS = {
    ("value_and_grad", "axis_name"): "the scaler's axis_name (no averaging)",
}


def preset_default(name: str) -> str:
    """``the preset's (torch: <value>)`` for a setting of ``create_scaler``."""
    from ampscale import PRESETS

    value = PRESETS["torch"].defaults.get(name, None)
    if isinstance(value, float) and value >= 1024 and value.is_integer() and (int(value) & (int(value) - 1)) == 0:
        shown = f"2.0**{int(value).bit_length() - 1}"
    else:
        shown = repr(value)
    return f"the preset's (torch: {shown})"


class AmpscaleApi(griffe.Extension):
    """Readable defaults and working cross-references in ampscale's API reference."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if pkg.name != PACKAGE:
            return
        public = _public_paths(pkg)
        for obj in _objects(pkg):
            if isinstance(obj, griffe.Function):
                _describe_defaults(obj)
            if obj.docstring is not None:
                link = functools.partial(_link, obj=obj, pkg=pkg, public=public)
                obj.docstring.value = ROLE.sub(link, obj.docstring.value)


def _objects(module: griffe.Module) -> list[griffe.Object]:
    """Every object defined in ``module`` and its submodules (aliases are visited where they point)."""
    found: list[griffe.Object] = []
    stack: list[griffe.Object] = [module]
    while stack:
        obj = stack.pop()
        found.append(obj)
        stack.extend(member for member in obj.members.values() if not member.is_alias)
    return found


def _public_paths(pkg: griffe.Module) -> dict[str, str]:
    """Canonical path -> public path, for the public modules' names and their classes' members."""
    paths: dict[str, str] = {}
    for module_path in PUBLIC_MODULES:
        try:
            module = pkg[module_path.removeprefix(PACKAGE).lstrip(".")] if module_path != PACKAGE else pkg
        except KeyError:
            continue
        for name, member in module.members.items():
            if name.startswith("_"):
                continue
            try:
                target = member.final_target if member.is_alias else member
            except (griffe.AliasResolutionError, griffe.CyclicAliasError):
                continue  # another package's object (torch's, jax's)
            if not target.path.startswith(PACKAGE):
                continue
            public = f"{module_path}.{name}"
            paths.setdefault(target.path, public)
            for attribute in target.members:
                paths.setdefault(f"{target.path}.{attribute}", f"{public}.{attribute}")
    return paths


def _resolve(name: str, obj: griffe.Object, pkg: griffe.Module) -> griffe.Object | None:
    scopes = []
    scope: griffe.Object | None = obj
    while scope is not None:
        if scope.is_class or scope.is_module:
            scopes.append(scope.path)
        scope = scope.parent
    candidates = [name] if name.startswith(f"{PACKAGE}.") else [*(f"{s}.{name}" for s in scopes), f"{PACKAGE}.{name}"]
    for candidate in candidates:
        relative = candidate.removeprefix(PACKAGE).lstrip(".")
        try:
            found = pkg[relative] if relative else pkg
            return found.final_target if found.is_alias else found
        except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
            continue
    return None


def _link(match: re.Match[str], obj: griffe.Object, pkg: griffe.Module, public: dict[str, str]) -> str:
    short, name = match.group(1), match.group(2)
    shown = name.rsplit(".", 1)[-1] if short else name
    target = _resolve(name, obj, pkg)
    if target is None:
        return f"`{shown}`"
    path = public.get(target.path, target.path)
    # the reference renders public objects only, and attributes only where they have a docstring
    private = any(part.startswith("_") and not part.startswith("__") for part in path.split("."))
    if private or (target.is_attribute and target.docstring is None):
        return f"`{shown}`"
    return f"[`{shown}`][{path}]"


def _describe_defaults(function: griffe.Function) -> None:
    for parameter in function.parameters:
        default = str(parameter.default) if parameter.default is not None else None
        if default == UNSET:
            special = SPECIAL_DEFAULTS.get((function.name, parameter.name))
            parameter.default = special or preset_default(parameter.name)
        elif default == SCALER_SETTING:
            parameter.default = "the scaler's axis_name"
