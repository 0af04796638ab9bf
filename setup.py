"""Builds the C++ extension ngram_service._native at install time (pybind11)."""

import subprocess
import sys
from pathlib import Path

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent
PROTO_PACKAGE = "ngram_service/_proto"  # generated stubs land here (not committed)


def generate_grpc_stubs() -> None:
    """protos/*.proto -> ngram_service/_proto/*_pb2(_grpc).py with package-qualified imports."""
    out = ROOT / PROTO_PACKAGE
    out.mkdir(exist_ok=True)
    (out / "__init__.py").write_text('"""gRPC stubs generated from protos/ at build time."""\n')
    protos = sorted(str(p.relative_to(ROOT / "protos")) for p in (ROOT / "protos").glob("*.proto"))
    cmd = [sys.executable, "-m", "grpc_tools.protoc", f"--proto_path={PROTO_PACKAGE}=protos",
           "--python_out=.", "--grpc_python_out=.", "--pyi_out=.", *[f"{PROTO_PACKAGE}/{p}" for p in protos]]
    subprocess.run(cmd, cwd=ROOT, check=True)


class BuildPyWithStubs(build_py):
    def run(self):
        generate_grpc_stubs()
        super().run()

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

setup(ext_modules=[native], cmdclass={"build_ext": build_ext, "build_py": BuildPyWithStubs})
