"""Builds the C++ extension ngram_service._native at install time (pybind11)."""

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

native = Pybind11Extension(
    "ngram_service._native",
    sources=[
        "ngram_service/csrc/module.cpp",
        "ngram_service/csrc/trie.cpp",
        "ngram_service/csrc/builder.cpp",
        "ngram_service/csrc/search.cpp",
    ],
    include_dirs=["ngram_service/csrc"],
    cxx_std=17,
    # Exact IEEE arithmetic: the tree search must match its Python reference bit for bit.
    extra_compile_args=["-O3", "-ffp-contract=off", "-pthread"],
    extra_link_args=["-pthread"],
)

setup(ext_modules=[native], cmdclass={"build_ext": build_ext})
