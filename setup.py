"""The one native part of memkv (memkv/native/kvcopy.c); everything else is in pyproject.toml.

Optional: without a C compiler memkv installs without it and copies with numpy.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "memkv.native._kvcopy",
    ["memkv/native/kvcopy.c"],
    extra_compile_args=["-O3"],
    optional=True,
)])
