"""Command line: ``python -m ampscale demo`` (the three-way fp16 demo) and ``python -m ampscale info``."""

from __future__ import annotations

import importlib
import sys

USAGE = """usage: python -m ampscale <command> [options]

commands:
  demo   train an fp16 MLP three ways (fp32, fp16, fp16 + ampscale) and compare (--help for options)
  info   show the version, the installed backends and the NumPy kernel in use
"""


def info() -> int:
    import ampscale
    from ampscale.backends import numpy as numpy_backend

    print(f"ampscale {ampscale.__version__}")
    print(f"backends installed: {', '.join(ampscale.available_backends())}")
    if numpy_backend.NATIVE:
        kernel = f"native ({numpy_backend.kernel_isa()}), {numpy_backend.num_threads()} threads"
    else:
        kernel = "pure NumPy (native kernel not built)"
    print(f"numpy kernel: {kernel}")
    if "jax" in ampscale.available_backends():  # imports jax; compiles its CPU handler on first use
        print(f"jax custom call: {importlib.import_module('ampscale.backends.jax').custom_call_status()}")
    print(f"presets: {', '.join(ampscale.PRESETS)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "demo":
        from ampscale.demo import main as demo_main

        return demo_main(rest)
    if command == "info":
        return info()
    if command in ("-V", "--version"):
        import ampscale

        print(ampscale.__version__)
        return 0
    print(f"unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
