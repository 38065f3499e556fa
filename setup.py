"""Builds the codec's optional C kernels (kvstore/core/_native.c); everything else about the
package is in pyproject.toml. The extension is optional: where it cannot be built, the
package installs without it and the codec runs its eager torch kernels (kvstore.core.native)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvstore.core._native",
            sources=["kvstore/core/_native.c"],
            # No contraction: every float32 operation rounds on its own, as torch's do.
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno", "-Wall"],
            optional=True,
        )
    ]
)
