"""Everything shared between test modules, one module per topic (tests/README.md lists them); shared
fixtures are in tests/conftest.py. A test module never imports from another test module."""
