"""The package's version, in a module of its own so that any layer can read it.

``kvvmm/__init__.py`` re-exports it; modules below the package root (``kvvmm.measure`` writes
it into every result) import it from here, since the root imports every layer.
"""

__version__ = "0.1.0"
