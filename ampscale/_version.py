"""The package version (one place: ``ampscale.__version__`` and the command line read it).

Foundation layer.
"""

__version__ = "0.1.0"
