"""Build hook: the wheel carries the runtime's compiled front-end (provision/inject/shim.c), so hosts without a C
compiler (a fresh Debian server, an offline bundle) still get it. `gpuprov runtime install` writes the host's paths
into that binary; it compiles shim.c itself only when the wheel has no binary that runs on the host, and installs the
Python front-end only when it cannot compile either (it says which in `gpuprov runtime install --json`).

A wheel that carries the binary is tagged for its platform: py3-none-manylinux2014_<arch> for a static binary (it
needs no shared library at all), py3-none-linux_<arch> for a dynamic one. Without a compiler at build time the wheel
stays pure (py3-none-any) and says so on stderr."""
import importlib.util
import platform
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

HERE = Path(__file__).resolve().parent
BINARY = "provision/inject/gpuprov-runtime.bin"


def _recipe():
    spec = importlib.util.spec_from_file_location("_gpuprov_frontend_build", HERE / "provision/inject/frontend_build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class BuildPy(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):  # editable installs compile at `runtime install` time
            return
        out = Path(self.build_lib) / BINARY
        link = _recipe().compile_front_end(out, lambda argv: subprocess.run(argv, capture_output=True).returncode)
        self.distribution.gpuprov_link = link
        if link is None:
            print("gpuprov: no C compiler: this wheel carries no compiled runtime front-end", file=sys.stderr)


class BdistWheel(bdist_wheel):
    def get_tag(self):
        link = getattr(self.distribution, "gpuprov_link", None)
        if link is None:
            return super().get_tag()
        self.root_is_pure = False
        arch = platform.machine()
        return "py3", "none", f"manylinux2014_{arch}" if link == "static" else f"linux_{arch}"


setup(cmdclass={"build_py": BuildPy, "bdist_wheel": BdistWheel})
