"""kit's stand-in for the ``returnn`` package, importable only while kit loads or runs a RETURNN config
and RETURNN itself is not installed (see :mod:`kit.compat.imports`)."""

__version__ = "0+kit.compat"
__long_version__ = __version__
KIT_FALLBACK = True


def __getattr__(name: str) -> object:
    """Anything else is RETURNN's own: one error saying what to install."""
    from kit.compat.imports import missing_attribute

    raise missing_attribute('returnn', name)
