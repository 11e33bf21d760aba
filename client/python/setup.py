"""Installs the Python package kvtrie:

    sudo /usr/bin/pip3 install --break-system-packages ./client/python

(Debian 12's pip, python3-pip; --break-system-packages because Debian marks its Python as
externally managed; the package lands in /usr/local/lib/python3.11/dist-packages and
`pip3 uninstall --break-system-packages kvtrie` removes it.) The extension module is built by the
project's CMake build: this runs deploy/install_deps.sh (installs only what is missing) and
deploy/build.sh kvtrie_python (into the repository's build/), then packages kvtrie/ with the
module. Without pyproject.toml on purpose: pip then builds with the system setuptools and needs
no network.
"""

import glob
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
BUILD = Path(os.environ.get("KVTRIE_BUILD_DIR", REPO / "build"))


class BinaryDistribution(Distribution):
    def has_ext_modules(self):  # a platform wheel: it carries _kvtrie*.so
        return True


class BuildWithCMake(build_py):
    def run(self):
        if not os.environ.get("KVTRIE_SKIP_DEPS"):
            subprocess.check_call([str(REPO / "deploy" / "install_deps.sh")])
        subprocess.check_call([str(REPO / "deploy" / "build.sh"), "kvtrie_python"])
        super().run()
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        built = glob.glob(str(BUILD / "client" / "python" / "kvtrie" / f"_kvtrie{suffix}"))
        if not built:
            raise RuntimeError(f"no _kvtrie{suffix} in {BUILD}/client/python/kvtrie: the module "
                               "is built for /usr/bin/python3; run this pip with that Python")
        out = Path(self.build_lib) / "kvtrie"
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built[0], out)


setup(
    name="kvtrie",
    version="0.1.0",
    description="Python client of kvtrie (a KV-cache store for LLM inference workers) and a "
                "vLLM-shaped KV connector",
    packages=["kvtrie"],
    package_data={"kvtrie": ["py.typed"]},
    python_requires=">=3.9",
    install_requires=["numpy"],
    cmdclass={"build_py": BuildWithCMake},
    distclass=BinaryDistribution,
    zip_safe=False,
)
