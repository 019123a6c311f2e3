"""SGLang's own `RadixCache` (v0.5.6), loaded on CPU for side-by-side parity runs.

Owns fetching SGLang's wheel (`pip download --no-deps` into a cache directory given by
the caller), extracting `python/sglang/srt/mem_cache/radix_cache.py` and the three
small modules it needs (`base_prefix_cache`, `evict_policy`, `cache_init_params`),
stubbing the heavy imports it does not use on this path (triton, zmq/msgspec KV-event
publishing, the GPU allocator and memory pools, Prometheus metrics), and `SGLangArm`:
SGLang's scheduler calls on that tree (`match_prefix` + `inc_lock_ref` at admission,
`cache_unfinished_req` after prefill, `cache_finished_req` with PR #16521's behaviour
at the end, `evict_from_tree_cache` when the allocator is short) behind the same
admit/commit/append/release calls the benchmark makes on our backend.

Must never: be imported by the library or the tests, vendor or commit SGLang code
(the wheel is fetched at run time into a directory outside the repository), or
change SGLang's tree logic: only its imports are stubbed.

The allocator is ours, not SGLang's `TokenToKVPoolAllocator` (which needs triton and
a KV pool): a page-granular free list of Python ints handing out torch int64 token
slots, O(pages) per call. SGLang's own allocator frees with `torch.cat` over the whole
free list, which costs more, so timing SGLang with ours flatters SGLang.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import types
import zipfile
from pathlib import Path
from typing import Any

__all__ = ["SGLangUnavailable", "load_sglang", "SGLangArm"]

VERSIONS = ("sglang==0.5.6.post2", "sglang==0.5.6.post1", "sglang==0.5.6")
_REAL_MODULES = ("cache_init_params", "evict_policy", "base_prefix_cache", "radix_cache")


class SGLangUnavailable(RuntimeError):
    """SGLang's RadixCache could not be loaded; the message says exactly why."""


def _fetch_wheel(cache_dir: Path) -> Path:
    cache_dir.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache_dir.glob("sglang-0.5.6*.whl"))
    if wheels:
        return wheels[-1]
    errors = []
    for spec in VERSIONS:
        cmd = [sys.executable, "-m", "pip", "download", spec, "--no-deps", "-d", str(cache_dir), "-q"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(cache_dir.glob("sglang-0.5.6*.whl"))
        if proc.returncode == 0 and wheels:
            return wheels[-1]
        errors.append(f"`{' '.join(cmd[2:])}` exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
    raise SGLangUnavailable("could not download SGLang 0.5.6.x: " + " | ".join(errors))


def _extract(wheel: Path, cache_dir: Path) -> Path:
    out = cache_dir / wheel.stem
    with zipfile.ZipFile(wheel) as zf:
        for name in _REAL_MODULES:
            member = f"sglang/srt/mem_cache/{name}.py"
            target = out / member
            if not target.exists():
                try:
                    zf.extract(member, out)
                except KeyError:
                    raise SGLangUnavailable(f"{wheel.name} has no {member}") from None
    return out / "sglang/srt/mem_cache"


def _stub(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    if "." not in name or not attrs:
        module.__path__ = []  # a package, so submodules can be registered under it
    sys.modules[name] = module
    return module


def _unused(what: str):
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise SGLangUnavailable(f"{what} is stubbed in this benchmark (events / EAGLE are off)")

    return fail


def load_sglang(cache_dir: str | Path) -> types.ModuleType:
    """SGLang's `radix_cache` module, its heavy imports stubbed. Raises SGLangUnavailable."""
    if "sglang.srt.mem_cache.radix_cache" in sys.modules:
        return sys.modules["sglang.srt.mem_cache.radix_cache"]
    try:
        import torch  # noqa: F401  (SGLang's tree stores KV indices in torch tensors)
    except ImportError as err:
        raise SGLangUnavailable(f"SGLang's RadixCache needs torch, which does not import: {err}") from None
    src = _extract(_fetch_wheel(Path(cache_dir)), Path(cache_dir))

    for pkg in ("sglang", "sglang.srt", "sglang.srt.mem_cache", "sglang.srt.disaggregation", "sglang.srt.metrics"):
        _stub(pkg)
    # kv_events pulls in zmq, msgspec and pydantic to publish events; events are off.
    _stub(
        "sglang.srt.disaggregation.kv_events",
        MEDIUM_GPU="GPU",
        BlockStored=_unused("BlockStored"),
        BlockRemoved=_unused("BlockRemoved"),
        AllBlocksCleared=_unused("AllBlocksCleared"),
    )
    _stub("sglang.srt.mem_cache.utils", convert_to_bigram_key=_unused("convert_to_bigram_key"))  # triton
    _stub(
        "sglang.srt.mem_cache.hicache_storage",  # host memory pools
        get_hash_str=_unused("get_hash_str"),
        hash_str_to_int64=_unused("hash_str_to_int64"),
    )
    _stub("sglang.srt.mem_cache.allocator", BaseTokenToKVPoolAllocator=object)  # triton kernels
    _stub("sglang.srt.mem_cache.memory_pool", ReqToTokenPool=object)  # GPU pools
    _stub("sglang.srt.metrics.collector", RadixCacheMetricsCollector=object)  # prometheus

    module = None
    for name in _REAL_MODULES:
        full = f"sglang.srt.mem_cache.{name}"
        spec = importlib.util.spec_from_file_location(full, src / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[full] = module
        try:
            spec.loader.exec_module(module)
        except Exception as err:  # any import-time failure is a reason to report
            raise SGLangUnavailable(f"importing {full} from {src} failed: {type(err).__name__}: {err}") from None
    assert module is not None
    return module


class _PageAllocator:
    """Page-granular free list handing out token slots, as SGLang's allocators do."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        import torch

        self.torch = torch
        self.page = page_size
        self.device = torch.device("cpu")
        self.free_pages = list(range(num_pages - 1, -1, -1))

    def available_size(self) -> int:
        return len(self.free_pages) * self.page

    def alloc_pages(self, n: int):
        if n > len(self.free_pages):
            return None
        pages = [self.free_pages.pop() for _ in range(n)]
        t = self.torch.tensor(pages, dtype=self.torch.int64)
        if self.page == 1:
            return t
        return (t[:, None] * self.page + self.torch.arange(self.page)).reshape(-1)

    def free(self, slots) -> None:
        """Free token slots (SGLang frees KV indices); whole pages go back."""
        if slots.numel() == 0:
            return
        if self.page == 1:
            self.free_pages += slots.tolist()
        else:
            self.free_pages += sorted(set((slots // self.page).tolist()))


class _Req:
    __slots__ = ("tokens", "key_extra", "kv", "last_node", "protected", "computed")


class SGLangArm:
    """SGLang's RadixCache driven the way SGLang's scheduler drives it."""

    def __init__(self, sglang: types.ModuleType, page_size: int, num_pages: int) -> None:
        params = sglang.CacheInitParams(
            disable=False,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=None,
            page_size=page_size,
            eviction_policy="lru",
        )
        self.tree = sglang.RadixCache(params)
        self.alloc = _PageAllocator(num_pages, page_size)
        self.tree.token_to_kv_pool_allocator = self.alloc
        self.RadixKey = sglang.RadixKey
        self.torch = self.alloc.torch
        self.page = page_size
        self.reqs: dict[Any, _Req] = {}

    def _alloc_pages(self, n: int):
        # mem_cache/common.py evict_from_tree_cache: short of room, evict what the
        # allocation needs (in tokens), then allocate.
        if self.alloc.available_size() < n * self.page:
            self.tree.evict(n * self.page)
        return self.alloc.alloc_pages(n)

    def admit(self, rid: Any, tokens: list[int], namespace: str | None = None) -> int | None:
        """match_prefix(tokens[:-1]) + inc_lock_ref + alloc; the hit in tokens, or None."""
        key = self.RadixKey(tokens[:-1], namespace)
        match = self.tree.match_prefix(key)
        hit = len(match.device_indices)
        need = -(-len(tokens) // self.page) - hit // self.page
        self.tree.inc_lock_ref(match.last_device_node)
        if need * self.page > self.alloc.available_size() + self.tree.evictable_size():
            self.tree.dec_lock_ref(match.last_device_node)
            return None
        req = _Req()
        req.tokens, req.key_extra = list(tokens), namespace
        req.kv = self.torch.cat([match.device_indices, self._alloc_pages(need)])
        req.last_node, req.protected, req.computed = match.last_device_node, hit, 0
        self.reqs[rid] = req
        return hit

    def append(self, rid: Any, tokens: list[int]) -> None:
        req = self.reqs[rid]
        need = -(-(len(req.tokens) + len(tokens)) // self.page) - -(-len(req.tokens) // self.page)
        if need > 0:
            req.kv = self.torch.cat([req.kv, self._alloc_pages(need)])
        req.tokens += tokens

    def _keys(self, req: _Req, computed: int):
        aligned = computed // self.page * self.page
        return self.RadixKey(req.tokens[:aligned], req.key_extra), aligned

    def commit(self, rid: Any, computed: int) -> None:
        """cache_unfinished_req: insert, free duplicates, re-match, move the lock."""
        req = self.reqs[rid]
        req.computed = computed
        key, aligned = self._keys(req, computed)
        if aligned == 0 or aligned < req.protected:
            return
        new_prefix_len = self.tree.insert(key, req.kv[:aligned].clone())
        self.alloc.free(req.kv[req.protected : new_prefix_len])
        match = self.tree.match_prefix(key)
        new_indices = match.device_indices
        req.kv[req.protected : len(new_indices)] = new_indices[req.protected :]
        req.protected = len(new_indices)
        self.tree.dec_lock_ref(req.last_node)
        self.tree.inc_lock_ref(match.last_device_node)
        req.last_node = match.last_device_node

    def release(self, rid: Any) -> None:
        """cache_finished_req with PR #16521: generated tokens whose KV is computed are cached."""
        req = self.reqs.pop(rid)
        key, aligned = self._keys(req, max(req.computed, req.protected))
        if aligned >= req.protected and aligned > 0:
            new_prefix_len = self.tree.insert(key, req.kv[:aligned].clone())
            self.alloc.free(req.kv[req.protected : new_prefix_len])
        else:
            aligned = req.protected
        self.alloc.free(req.kv[aligned:])
        self.tree.dec_lock_ref(req.last_node)
