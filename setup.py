"""Build script: the `prefixcache` packages and the native extension `prefixcache._C`.

`backends/` is installed as `prefixcache.backends` (not a top-level module), so the
strategies live beside the core in the user's tree but import as part of the package.
Likewise `configs/*.yaml` (and the demo prompts, `configs/prompts.jsonl`) ship as package
data of `prefixcache.configs`, so an installed `prefixcache ab` finds its default A/B file
through importlib.resources.

`PREFIXCACHE_CUDA=auto|1|0` decides whether csrc/*.cu is compiled into `_C` with nvcc
(auto: when nvcc is found; 1: required; 0: never). The CUDA runtime is linked statically
so the module imports on a machine without a driver. The .cu source is also copied next
to the extension, where the cupy (NVRTC) path finds it at run time.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext, has_flag
from setuptools import find_packages, setup

ROOT = Path(__file__).parent
CUDA_ARCHS = ("80", "90")  # A100, H100/H200; PTX for 90 as well, for newer GPUs to JIT

# One compiler process per core (PREFIXCACHE_BUILD_JOBS overrides): the csrc/ files
# are independent, and a sanitized build is several times slower to compile.
ParallelCompile("PREFIXCACHE_BUILD_JOBS", default=0).install()


def native_extension() -> Pybind11Extension:
    sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").glob("*.cpp"))
    extra_compile_args = ["-O3", "-ffp-contract=fast"] if sys.platform != "win32" else ["/O2"]
    extra_link_args: list[str] = []
    sanitize = os.environ.get("PREFIXCACHE_SANITIZE", "").strip()
    if sanitize:
        # -O0 -g1: line tables for the reports, and a third of -O1 -g's compile time
        # (the pybind11 binding files dominate); the checks are the same.
        flags = [f"-fsanitize={sanitize}", "-fno-omit-frame-pointer", "-g1"]
        extra_compile_args = ["-O0", *flags]
        extra_link_args += flags
    # The headers too: an edit to one alone must rebuild the extension (setuptools rebuilds
    # when any of sources + depends is newer than the built module).
    headers = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").glob("*.h"))
    return Pybind11Extension(
        "prefixcache._C",
        sources,
        depends=headers,
        include_dirs=["csrc"],
        cxx_std=20,
        extra_compile_args=extra_compile_args,
        extra_link_args=extra_link_args,
    )


def find_nvcc() -> Path | None:
    for candidate in (shutil.which("nvcc"), os.environ.get("CUDA_HOME", "") + "/bin/nvcc", "/usr/local/cuda/bin/nvcc"):
        if candidate and Path(candidate).is_file():
            return Path(candidate).resolve()
    return None


class BuildExt(build_ext):
    """pybind11's build_ext plus OpenMP when the compiler has it and csrc/*.cu via nvcc."""

    def build_extensions(self) -> None:
        for ext in self.extensions:
            if has_flag(self.compiler, "-fopenmp"):
                ext.extra_compile_args.append("-fopenmp")
                ext.extra_link_args.append("-fopenmp")
            self._add_cuda(ext)
        super().build_extensions()
        for ext in self.extensions:  # the cupy path compiles the same source at first use
            for cu in (ROOT / "csrc").glob("*.cu"):
                shutil.copyfile(cu, Path(self.get_ext_fullpath(ext.name)).parent / cu.name)

    def _add_cuda(self, ext: Pybind11Extension) -> None:
        mode = os.environ.get("PREFIXCACHE_CUDA", "auto").strip().lower()
        if mode not in ("auto", "1", "0"):
            raise SystemExit(f"PREFIXCACHE_CUDA must be auto, 1 or 0; got {mode!r}")
        nvcc = find_nvcc() if mode != "0" else None
        if nvcc is None:
            if mode == "1":
                raise SystemExit("PREFIXCACHE_CUDA=1 but nvcc was not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)")
            return
        gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in CUDA_ARCHS]
        gencode.append(f"-gencode=arch=compute_{CUDA_ARCHS[-1]},code=compute_{CUDA_ARCHS[-1]}")
        out_dir = Path(self.build_temp) / "cuda"
        out_dir.mkdir(parents=True, exist_ok=True)
        for cu in sorted((ROOT / "csrc").glob("*.cu")):
            obj = out_dir / (cu.stem + ".o")
            cmd = [str(nvcc), "-c", str(cu), "-o", str(obj), "-O3", "-std=c++17", "-Xcompiler", "-fPIC",
                   f"-I{ROOT / 'csrc'}", *gencode]
            print(" ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
            ext.extra_objects.append(str(obj))
        ext.define_macros.append(("PREFIXCACHE_WITH_CUDA", "1"))
        # nvcc may be a wrapper script (/usr/local/bin/nvcc), so look for the runtime in the
        # usual CUDA homes too, not only beside it.
        homes = [os.environ.get("CUDA_HOME"), nvcc.parent.parent, "/usr/local/cuda"]
        libs = [Path(h) / sub for h in homes if h for sub in ("lib64", "lib")]
        lib_dir = next((d for d in libs if (d / "libcudart_static.a").is_file()), None)
        if lib_dir is None:
            raise SystemExit(f"libcudart_static.a not found in {', '.join(map(str, libs))}")
        ext.library_dirs.append(str(lib_dir))
        ext.libraries += ["cudart_static", "rt", "dl", "pthread"]


packages = find_packages(include=["prefixcache", "prefixcache.*"])
packages += ["prefixcache.backends", "prefixcache.configs"]

setup(
    packages=packages,
    package_dir={"prefixcache": "prefixcache", "prefixcache.backends": "backends", "prefixcache.configs": "configs"},
    package_data={"prefixcache.configs": ["*.yaml", "*.jsonl"]},
    ext_modules=[native_extension()],
    cmdclass={"build_ext": BuildExt},
    zip_safe=False,
)
