"""Builds peerd's optional native data plane (peerd._dataplane._native) against CPython's headers and the system
OpenSSL's libcrypto (EVP AES-256-GCM). Everything else is in pyproject.toml.

The extension is optional: without a C compiler or OpenSSL's headers (Debian: gcc, libssl-dev) the build warns,
installing still succeeds, and peerd runs its Python data path (``peerd.wire.native`` says which one runs).
PEERD_DATAPLANE_CFLAGS adds compiler flags (the fuzz harness builds an AddressSanitizer copy with it).
"""

from __future__ import annotations

import os
import shlex

from setuptools import Extension, setup

extra = shlex.split(os.environ.get("PEERD_DATAPLANE_CFLAGS", ""))

setup(
    ext_modules=[
        Extension(
            "peerd._dataplane._native",
            sources=["peerd/_dataplane/dataplane.c"],
            libraries=["crypto"],
            extra_compile_args=["-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter", *extra],
            extra_link_args=[f for f in extra if f.startswith("-fsanitize")],
            optional=True,
        )
    ],
)
