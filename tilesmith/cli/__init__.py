"""The ``tilesmith`` command line: ``doctor``, ``runs``, ``show``, ``cache`` and ``report``.

It reads run folders (docs/layout.md) and the artifact store; it never runs a model. Entry point:
:func:`tilesmith.cli.main.main`.
"""
