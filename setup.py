"""Build hook for kvroute's two optional C accelerators (metadata lives in pyproject.toml).

Both extensions are `optional`: where no C compiler is available the install still succeeds and
the indexer runs on its pure-Python fallbacks (same results, slower, larger; see
docs/indexer.md). `python3 -m pytest` fails loudly if they are missing unless
KVROUTE_PURE_PYTHON=1 asks for the fallbacks on purpose.
"""

from setuptools import Extension, setup

_FLAGS = ["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror=implicit-function-declaration"]

setup(
    ext_modules=[
        Extension(
            "indexer._intmap", ["indexer/_intmap.c"], optional=True, extra_compile_args=_FLAGS
        ),
        Extension(
            "indexer._keychain", ["indexer/_keychain.c"], optional=True, extra_compile_args=_FLAGS
        ),
    ]
)
