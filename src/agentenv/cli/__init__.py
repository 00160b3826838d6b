"""The ``aenv`` command line."""
