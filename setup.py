"""The optional C kernels (ckpttool/kernels/native/): built where a C compiler is found, skipped with a
warning where not (the CPU path then runs numba's or numpy's loops, the same bits, and a conversion that
ran numpy's says so). CKPTTOOL_BUILD_NATIVE=0 leaves them out on purpose: a pure `py3-none-any` wheel that
installs everywhere (README: Packaging). Everything else is in pyproject.toml."""

import os

from setuptools import Extension, setup

NATIVE = Extension(
    "ckpttool.kernels._native",  # a plain C library that kernels/native.py loads with ctypes, not a module
    sources=["ckpttool/kernels/native/fp8.c", "ckpttool/kernels/native/scaled.c", "ckpttool/kernels/native/grouped.c",
             "ckpttool/kernels/native/window.c", "ckpttool/kernels/native/mxfp4.c",
             "ckpttool/kernels/native/packed.c", "ckpttool/kernels/native/bnb.c",
             "ckpttool/kernels/native/fp8_scaled.c", "ckpttool/kernels/native/quant.c",
             "ckpttool/kernels/native/ct_gidx.c"],
    depends=["ckpttool/kernels/native/bf16.h", "ckpttool/kernels/native/block8.h"],
    extra_compile_args=["-O3", "-funroll-loops", "-std=c99"],
    optional=True,
)

setup(ext_modules=[] if os.environ.get("CKPTTOOL_BUILD_NATIVE") == "0" else [NATIVE])
