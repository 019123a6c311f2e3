"""Build script: the `prefixcache` packages and the native extension `prefixcache._C`.

`backends/` is installed as `prefixcache.backends` (not a top-level module), so the
strategies live beside the core in the user's tree but import as part of the package.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import find_packages, setup

ROOT = Path(__file__).parent

# One compiler process per core (PREFIXCACHE_BUILD_JOBS overrides): the csrc/ files
# are independent, and a sanitized build is several times slower to compile.
ParallelCompile("PREFIXCACHE_BUILD_JOBS", default=0).install()


def native_extension() -> Pybind11Extension:
    sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").glob("*.cpp"))
    extra_compile_args = ["-O3"] if sys.platform != "win32" else ["/O2"]
    extra_link_args: list[str] = []
    sanitize = os.environ.get("PREFIXCACHE_SANITIZE", "").strip()
    if sanitize:
        flags = [f"-fsanitize={sanitize}", "-fno-omit-frame-pointer", "-g"]
        extra_compile_args = ["-O1", *flags]
        extra_link_args += flags
    return Pybind11Extension(
        "prefixcache._C",
        sources,
        include_dirs=["csrc"],
        cxx_std=20,
        extra_compile_args=extra_compile_args,
        extra_link_args=extra_link_args,
    )


packages = find_packages(include=["prefixcache", "prefixcache.*"])
packages.append("prefixcache.backends")

setup(
    packages=packages,
    package_dir={"prefixcache": "prefixcache", "prefixcache.backends": "backends"},
    ext_modules=[native_extension()],
    cmdclass={"build_ext": build_ext},
    zip_safe=False,
)
