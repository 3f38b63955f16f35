"""The planning defaults of :mod:`secagg.params`, in a module that imports nothing.

Help texts (``secagg bench aggregation --help``) print them; importing :mod:`secagg.params` for two
numbers would load numpy first. :mod:`secagg.params` re-exports both, so either import works.
"""

__all__ = ["DEFAULT_CORRUPT", "DEFAULT_DROPOUT"]

DEFAULT_DROPOUT = 0.1  #: planned dropout fraction when the caller gives none
DEFAULT_CORRUPT = 0.05  #: tolerated fraction of clients colluding with the server by default
