"""A model family as a plugin writes one: this folder plus one entry point line,
``toyfam = toy_family.family:FAMILY`` in the ``hetfair.families`` group (``tests/test_families.py``
installs it so, in a ``*.dist-info`` of its own). Importing the package imports nothing."""
