"""Helpers shared by test modules: a test module imports from here or from a conftest, never from
another test module (fixtures shared by a directory live in its ``conftest.py``)."""
