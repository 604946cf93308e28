"""What an experiment is, shared by the ServerApp and the ClientApp: the method registry.

Both apps import this package; it imports :mod:`models` and nothing of ``server/``,
``client/`` or ``strategies/``, so the two apps can agree on what a method is without
importing each other.
"""
