"""Installs the Python package kvtrie into the Python that runs pip (3.9 or newer):

    python3 -m venv --system-site-packages /opt/kv && /opt/kv/bin/pip install \
        --no-build-isolation ./client/python                # a venv (vLLM's, for instance)
    sudo /usr/bin/pip3 install --break-system-packages ./client/python  # Debian's python3

The extension module _kvtrie is built by the project's CMake for *that* interpreter
(sys.executable, passed as -DPython3_EXECUTABLE) into a build directory of its own per ABI,
build-py-<SOABI> beside build/ (e.g. build-py-cpython-311-x86_64-linux-gnu; $KVTRIE_PY_BUILD_DIR
overrides, but not with build/ itself: its cache would be reconfigured without tests), so one checkout installs into several Pythons and a rebuild reuses the objects. At
the same depth as build/ on purpose: ccache (with base_dir set) then hits on build/'s objects.
pybind11: the one installed in that Python (`pip install pybind11`) when importable, else
Debian's pybind11-dev (its CMake config). The interpreter needs its headers (python3-dev, or a
Python built with them). Before building, this runs deploy/install_deps.sh (installs only the
Debian packages that are missing; root or sudo); KVTRIE_SKIP_DEPS=1 skips it. KVTRIE_BUILD_JOBS=N caps the build's parallel jobs.

Without pyproject.toml on purpose: with --no-build-isolation (or Debian's pip3, which builds with
the system setuptools) pip needs no network. numpy is the only runtime dependency.
"""

import glob
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


def build_dir() -> Path:
    """Where the extension for this interpreter is built: one directory per ABI."""
    if os.environ.get("KVTRIE_PY_BUILD_DIR"):
        return Path(os.environ["KVTRIE_PY_BUILD_DIR"])
    tag = sysconfig.get_config_var("SOABI") or "py%d%d" % sys.version_info[:2]
    return REPO / f"build-py-{tag}"


def cmake_args(build: Path):
    args = ["cmake", "-S", str(REPO), "-B", str(build), "-G", "Ninja",
            "-DCMAKE_BUILD_TYPE=" + os.environ.get("CMAKE_BUILD_TYPE", "RelWithDebInfo"),
            "-DPython3_EXECUTABLE=" + sys.executable, "-DKVTRIE_BUILD_PYTHON=ON",
            "-DKVTRIE_BUILD_TESTS=OFF", "-DKVTRIE_BUILD_BENCH=OFF"]
    if shutil.which("ccache"):
        args.append("-DCMAKE_CXX_COMPILER_LAUNCHER=ccache")
    try:  # pybind11 from pip in this interpreter, else CMake finds Debian's pybind11-dev
        import pybind11  # noqa: PLC0415
        args.append("-Dpybind11_DIR=" + pybind11.get_cmake_dir())
    except ImportError:
        pass
    return args


class BinaryDistribution(Distribution):
    def has_ext_modules(self):  # a platform wheel: it carries _kvtrie*.so
        return True


class BuildWithCMake(build_py):
    def run(self):
        if not os.environ.get("KVTRIE_SKIP_DEPS"):
            subprocess.check_call([str(REPO / "deploy" / "install_deps.sh")])
        build = build_dir()
        subprocess.check_call(cmake_args(build))
        cmd = ["cmake", "--build", str(build), "--target", "kvtrie_python"]
        if os.environ.get("KVTRIE_BUILD_JOBS"):
            cmd += ["-j", os.environ["KVTRIE_BUILD_JOBS"]]
        # As deploy/build.sh: ccache hashes paths relative to the build directory, so the objects
        # deploy/build.sh compiled into build/ are reused here (build-py-* is also one level down).
        env = dict(os.environ)
        env.setdefault("CCACHE_BASEDIR", str(REPO))
        env.setdefault("CCACHE_NOHASHDIR", "1")
        subprocess.check_call(cmd, env=env)
        super().run()
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        built = glob.glob(str(build / "client" / "python" / "kvtrie" / f"_kvtrie{suffix}"))
        if not built:
            raise RuntimeError(f"no _kvtrie{suffix} in {build}/client/python/kvtrie after "
                               f"building for {sys.executable}")
        out = Path(self.build_lib) / "kvtrie"
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built[0], out)


setup(
    name="kvtrie",
    version="0.1.0",
    description="Python client of kvtrie (a KV-cache store for LLM inference workers) and a "
                "vLLM KV connector",
    packages=["kvtrie"],
    package_data={"kvtrie": ["py.typed"]},
    python_requires=">=3.9",
    install_requires=["numpy"],
    cmdclass={"build_py": BuildWithCMake},
    distclass=BinaryDistribution,
    zip_safe=False,
)
