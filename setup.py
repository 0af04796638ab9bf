"""Builds the C++ extensions ngram_service._native (the n-gram trie and tree search) and dart_core._kernels
(row-exact CPU attention) at install time (pybind11)."""

import subprocess
import sys
from pathlib import Path

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent
PROTO_PACKAGES = {  # generated stubs land here (not committed)
    "ngram.proto": "ngram_service/_proto",  # internal tree-search RPC
    "dart.proto": "deployments/_proto",  # public generation API (Serve gRPC proxy)
}


def generate_grpc_stubs() -> None:
    """protos/X.proto -> <package>/_proto/X_pb2(_grpc).py with package-qualified imports."""
    for proto, package in PROTO_PACKAGES.items():
        out = ROOT / package
        out.mkdir(exist_ok=True)
        (out / "__init__.py").write_text('"""gRPC stubs generated from protos/ at build time."""\n')
        cmd = [sys.executable, "-m", "grpc_tools.protoc", f"--proto_path={package}=protos",
               "--python_out=.", "--grpc_python_out=.", "--pyi_out=.", f"{package}/{proto}"]
        subprocess.run(cmd, cwd=ROOT, check=True)


class BuildPyWithStubs(build_py):
    """Generates the stubs before copying the packages; the stub packages are added to the
    package list here because package discovery ran before they existed (a clean checkout has
    no _proto folders), which left them out of non-editable installs (`pip install .`)."""

    def finalize_options(self):
        super().finalize_options()
        for package in PROTO_PACKAGES.values():
            init = ROOT / package / "__init__.py"
            if not init.is_file():  # the folder must exist from here on; run() fills it
                init.parent.mkdir(exist_ok=True)
                init.write_text('"""gRPC stubs generated from protos/ at build time."""\n')
            name = package.replace("/", ".")
            if name not in self.packages:
                self.packages.append(name)

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
        "ngram_service/csrc/context_index.cpp",
        "ngram_service/csrc/level_writer.cpp",
        "ngram_service/csrc/mapped_file.cpp",
        "ngram_service/csrc/reference_trie.cpp",
    ],
    include_dirs=["ngram_service/csrc"],
    cxx_std=17,
    # Exact IEEE arithmetic: the tree search must match its Python reference bit for bit.
    extra_compile_args=["-O3", "-ffp-contract=off", "-pthread"],
    extra_link_args=["-pthread"],
)

kernels = Pybind11Extension(
    "dart_core._kernels",
    sources=["dart_core/csrc/attention.cpp", "dart_core/csrc/qmm.cpp", "dart_core/csrc/qmm_a8.cpp",
             "dart_core/csrc/kv_compact.cpp", "dart_core/csrc/accept.cpp"],
    cxx_std=17,
    # Exact IEEE arithmetic (row-exact attention: the same bits for a row however it is batched);
    # -fno-trapping-math changes no result, it lets the compiler vectorise the exp's clamp.
    # OpenMP: libgomp.so.1, the runtime PyTorch's CPU wheels load, so the extension joins their pool.
    extra_compile_args=["-O3", "-ffp-contract=off", "-fno-trapping-math", "-fopenmp"],
    extra_link_args=["-fopenmp"],
)

setup(ext_modules=[native, kernels], cmdclass={"build_ext": build_ext, "build_py": BuildPyWithStubs})
