"""Command line: ``python -m ampscale demo`` (the three-way fp16 demo) and ``python -m ampscale info``.

The top of the house (framework helpers' layer): it may use every layer below.
"""

from __future__ import annotations

import json
import os
import sys

__all__ = ["CLOSED_PIPE", "USAGE", "info", "main"]

USAGE = """ampscale: dynamic loss scaling for mixed-precision (float16) training, on NumPy, CuPy,
JAX and PyTorch: scale the loss, unscale and check the gradients, skip the steps that
overflowed, and adjust the scale (the policy of torch.amp.GradScaler, or of another system).

usage: python -m ampscale <command> [options]
       python -m ampscale --version

commands:
  demo   train an fp16 MLP three ways (fp32, fp16, fp16 + ampscale) and compare (--help for options)
  info   show the version and, per backend, whether it is installed and can compute on a device
         (--json: the same facts as JSON, as ampscale.info() returns them)
"""


def info(args: list[str] | None = None) -> int:
    """``python -m ampscale info [--json]``: print :func:`ampscale.info`'s facts."""
    from ampscale._info import format_info
    from ampscale._info import info as collect

    options = [] if args is None else args
    unknown = [a for a in options if a != "--json"]
    if unknown:
        print(f"unknown option {unknown[0]!r} for info; accepted: --json", file=sys.stderr)
        return 2
    facts = collect()
    print(json.dumps(facts, indent=2) if "--json" in options else format_info(facts))
    return 0


#: the exit status of a command whose reader closed the pipe: a shell's for a process that
#: SIGPIPE ended (128 + 13), as ``yes | head -1`` reports for ``yes``
CLOSED_PIPE = 141


def main(argv: list[str] | None = None) -> int:
    """Run the command in ``argv`` (default: ``sys.argv[1:]``) and return its exit status.

    Output piped to a reader that stops early (``python -m ampscale info | head -1``) ends the
    command quietly, as Unix tools end, with status :data:`CLOSED_PIPE` and no traceback.
    """
    try:
        status = _run(sys.argv[1:] if argv is None else argv)
        sys.stdout.flush()  # here, not at exit: a closed pipe then raises where it is caught
    except BrokenPipeError:
        # Python flushes stdout again at exit, which would fail the same way and print
        # "Exception ignored ...": what is left to write goes nowhere instead.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return CLOSED_PIPE
    return status


def _run(args: list[str]) -> int:
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "demo":
        from ampscale.demo import main as demo_main

        return demo_main(rest)
    if command == "info":
        return info(rest)
    if command in ("-V", "--version"):
        import ampscale

        print(ampscale.__version__)
        return 0
    print(f"unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
