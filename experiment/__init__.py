"""What an experiment is, shared by the ServerApp and the ClientApp.

- :mod:`experiment.config`: the typed run configuration (``RunConfig``), validated once from
  Flower's flat run config, and what it derives (model family, catalog, data and training
  settings);
- :mod:`experiment.registry`: the method registry, one entry per method;
- :mod:`experiment.protocol`: the messages between the apps (record names, keys, parsers);
- :mod:`experiment.outputs`: the names of a run's results files (the ServerApp writes them, the
  launcher reads them).

Both apps import this package; it imports :mod:`models` and nothing of ``server/``,
``client/`` or ``strategies/`` (``tests/test_boundaries.py``), so the two apps agree on a run
and its messages without importing each other.
"""
