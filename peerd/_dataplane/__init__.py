"""peerd's optional native data plane: the C extension ``_native`` (dataplane.c), built by setup.py when a compiler
and OpenSSL's headers are there. Import it through ``peerd.wire.native``, which falls back to the Python path."""
