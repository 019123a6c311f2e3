"""SGLang 0.5.23's own `RadixCache`, loaded on CPU and driven as its scheduler drives it.

Owns finding SGLang's source (a directory given by the caller, e.g. a checkout's
`python/` or an unpacked wheel, or else `pip download sglang==0.5.23 --no-deps` into a
cache directory), loading the modules the radix cache's path runs, unchanged, from that
source (`mem_cache/radix_cache.py`, `base_prefix_cache`, `evict_policy`, `utils`,
`events`, `cache_init_params`, `common` -- where `match_kv_cache`, `checkpoint_kv_cache`,
`evict_from_tree_cache` and `release_kv_cache` live -- `allocator/base.py`, `environ`,
and from `managers/schedule_batch.py` the `ReqKvInfo` dataclass and the `Req` methods
those functions call), stubbing the heavy imports they do not use on this path (triton
kernels, KV-event publishing, host memory, Prometheus metrics, the server's runtime
context), and `SGLangArm`: the scheduler's calls behind the benchmark's
admit / prefilled / decode / release.

Must never: be imported by the library or the tests, vendor or commit SGLang code (the
source is read at run time from outside the repository), or change SGLang's logic: only
imports are stubbed, and each stub says what it stands for.

How the scheduler's calls are replayed, one request at a time (prefill unchunked, i.e.
`--chunked-prefill-size -1`; requests at priority None; schedule policy fcfs):
- admission: `Req.init_next_round_input` (`refresh_fill_ids`, then `match_kv_cache` on
  the prompt with `limit = _compute_max_prefix_len`), `PrefillAdder`'s
  `req.lock = tree_cache.lock(req.last_node)`, then `alloc_for_extend`: the prefix's
  indices (`prefix_device_indices`) and new slots into the request's `req_to_token` row,
  after `evict_from_tree_cache` for the allocator's extend demand
  (`get_extend_allocation_demand`: the extend's tokens plus a page per request with
  pages, exactly the extend without).
- after the prefill: `checkpoint_kv_cache` (the request is not finished).
- each decode step (one per generated token but the last, whose KV is never computed):
  `check_decode_mem` (`allocator.check_decode_capacity` for the pages the step needs),
  then `alloc_for_decode` (`evict_from_tree_cache` for a page per request with pages, a
  token without; a slot, from a new page when the last one is full), `kv_committed_len
  += 1`, the token appended to `output_ids`.
- finish: `release_kv_cache(req, tree_cache, checkpoint=True)`.
- refused: when the pages the prompt needs exceed free + evictable pages after the
  match is locked (the benchmark's pools hold any request, so this is a guard).

The allocator is ours (SGLang's `TokenToKVPoolAllocator` frees with `torch.cat` over the
whole free list and its paged one needs triton): a page-granular free list of Python
ints, O(pages) per call, on top of SGLang's own `BaseTokenToKVPoolAllocator`, so the
capacity hooks (`evict_to_free_tokens`, `check_decode_capacity`, `free_segments`) are
SGLang's. It is cheaper than SGLang's, so timing SGLang with it flatters SGLang.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
import types
import zipfile
from array import array
from pathlib import Path
from typing import Any

__all__ = ["SGLangUnavailable", "SGLangSource", "load_sglang", "SGLangArm", "VERSION"]

VERSION = "0.5.23"
_SRT = "sglang/srt"
# Files read from SGLang's source, relative to the directory holding `sglang/`.
_FILES = (
    "sglang/_version.py",
    f"{_SRT}/environ.py",
    f"{_SRT}/utils/common.py",
    f"{_SRT}/dllm/mixin/req.py",
    f"{_SRT}/managers/schedule_batch.py",
    f"{_SRT}/mem_cache/unified_cache/component_type.py",
    f"{_SRT}/mem_cache/allocator/base.py",
    f"{_SRT}/mem_cache/evict_policy.py",
    f"{_SRT}/mem_cache/utils.py",
    f"{_SRT}/mem_cache/events.py",
    f"{_SRT}/mem_cache/cache_init_params.py",
    f"{_SRT}/mem_cache/base_prefix_cache.py",
    f"{_SRT}/mem_cache/radix_cache.py",
    f"{_SRT}/mem_cache/common.py",
)


class SGLangUnavailable(RuntimeError):
    """SGLang's RadixCache could not be loaded; the message says exactly why."""


# -- finding the source ------------------------------------------------------------------
def _fetch_wheel(cache_dir: Path) -> Path:
    cache_dir.mkdir(parents=True, exist_ok=True)
    pattern = f"sglang-{VERSION}-*.whl"
    wheels = sorted(cache_dir.glob(pattern))
    if wheels:
        return wheels[-1]
    cmd = [sys.executable, "-m", "pip", "download", f"sglang=={VERSION}", "--no-deps", "-d", str(cache_dir), "-q"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(cache_dir.glob(pattern))
    if proc.returncode == 0 and wheels:
        return wheels[-1]
    raise SGLangUnavailable(f"could not download SGLang {VERSION}: `{' '.join(cmd[2:])}` exited "
                            f"{proc.returncode}: {proc.stderr.strip()[-300:]}")  # fmt: skip


def _unpack(wheel: Path, cache_dir: Path) -> Path:
    out = cache_dir / wheel.stem
    with zipfile.ZipFile(wheel) as zf:
        for member in _FILES:
            if not (out / member).exists():
                try:
                    zf.extract(member, out)
                except KeyError:
                    raise SGLangUnavailable(f"{wheel.name} has no {member}") from None
    return out


class SGLangSource:
    """Where SGLang's files are read from, and which version they are."""

    def __init__(self, root: Path, origin: str) -> None:
        self.root = root
        self.origin = origin
        missing = [f for f in _FILES[1:] if not (root / f).is_file()]
        if missing:
            raise SGLangUnavailable(f"{root} is not SGLang's source: no {', '.join(missing[:3])}")
        version = root / _FILES[0]
        self.version = "unknown (no sglang/_version.py)"
        if version.is_file():
            tree = ast.parse(version.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.count(".") == 2:
                    self.version = node.value
                    break

    @classmethod
    def find(cls, src: str | Path | None, cache_dir: str | Path) -> SGLangSource:
        """`src`: a directory holding `sglang/` (a checkout's `python/`, an unpacked wheel);
        else SGLang's wheel from the package index, unpacked under `cache_dir`."""
        if src is not None:
            root = Path(src)
            if (root / "python" / "sglang").is_dir():
                root = root / "python"
            return cls(root, f"source directory {root}")
        wheel = _fetch_wheel(Path(cache_dir))
        return cls(_unpack(wheel, Path(cache_dir)), f"wheel {wheel.name}")

    def path(self, rel: str) -> Path:
        return self.root / rel


# -- loading -----------------------------------------------------------------------------
def _stub(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    module.__path__ = []  # a package too, so submodules can be registered under it
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, module)
    return module


def _unused(what: str):
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise SGLangUnavailable(f"{what} is stubbed in this benchmark: its path (events, EAGLE, SWA, "
                                "hierarchical cache, metrics) is off")  # fmt: skip

    return fail


def _load(source: SGLangSource, name: str, rel: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, source.path(rel))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, module)
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # any import-time failure is a reason to report
        raise SGLangUnavailable(f"importing {name} from {source.path(rel)} failed: {type(err).__name__}: {err}") from None
    return module


def _definitions(source: SGLangSource, rel: str, names: dict[str, list[str] | None], namespace: dict) -> dict:
    """SGLang's own top-level functions / classes `names` from file `rel` (a class with a
    method list: just those methods, as plain functions), executed in `namespace`, for
    the pieces of modules too heavy to import whole (schedule_batch, utils.common)."""
    tree = ast.parse(source.path(rel).read_text())
    out: dict = {}
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name not in names:
            continue
        methods = names[node.name]
        body = [node] if methods is None else [n for n in node.body if isinstance(n, ast.FunctionDef) and n.name in methods]
        if methods is not None and len(body) != len(methods):
            raise SGLangUnavailable(f"{rel}: {node.name} lacks some of {methods}")
        module = ast.Module(body=body, type_ignores=[])
        exec(compile(module, str(source.path(rel)), "exec"), namespace)  # noqa: S102 (SGLang's code, read-only)
        if methods is None:
            out[node.name] = namespace[node.name]
        else:
            out[node.name] = {m: namespace[m] for m in methods}
    missing = set(names) - set(out)
    if missing:
        raise SGLangUnavailable(f"{rel} defines no {', '.join(sorted(missing))}")
    return out


class SGLang(types.SimpleNamespace):
    """The loaded pieces: `radix_cache`, `common`, `base_prefix_cache`, `allocator_base`,
    `ReqKvInfo`, `req_methods`, and the `source` they came from."""


_LOADED: SGLang | None = None


def load_sglang(src: str | Path | None, cache_dir: str | Path) -> SGLang:
    """SGLang's radix cache and scheduler helpers, heavy imports stubbed. Raises SGLangUnavailable."""
    global _LOADED
    if _LOADED is not None:
        return _LOADED
    try:
        import numpy  # noqa: F401
        import torch  # noqa: F401  (SGLang's tree stores KV indices in torch tensors)
    except ImportError as err:
        raise SGLangUnavailable(f"SGLang's RadixCache needs torch and numpy: {err}") from None
    source = SGLangSource.find(src, cache_dir)
    if source.version != VERSION and src is None:
        raise SGLangUnavailable(f"{source.origin} is SGLang {source.version}, not {VERSION}")

    for pkg in ("sglang", "sglang.srt", "sglang.srt.mem_cache", "sglang.srt.mem_cache.allocator",
                "sglang.srt.mem_cache.unified_cache", "sglang.srt.mem_cache.cpp_utils", "sglang.srt.disaggregation",
                "sglang.srt.observability", "sglang.srt.utils", "sglang.kernels", "sglang.kernels.ops",
                "sglang.kernels.ops.kvcache", "sglang.kernels.ops.memory", "sglang.srt.managers"):  # fmt: skip
        _stub(pkg)
    common_fns = _definitions(source, f"{_SRT}/utils/common.py", {"ceil_div": None, "ceil_align": None}, {})
    _stub("sglang.srt.utils.common", **common_fns)
    _load(source, "sglang.srt.environ", f"{_SRT}/environ.py")
    component_type = _load(source, "sglang.srt.mem_cache.unified_cache.component_type",
                           f"{_SRT}/mem_cache/unified_cache/component_type.py")  # fmt: skip
    allocator_base = _load(source, "sglang.srt.mem_cache.allocator.base", f"{_SRT}/mem_cache/allocator/base.py")
    sys.modules["sglang.srt.mem_cache.allocator"].BaseTokenToKVPoolAllocator = allocator_base.BaseTokenToKVPoolAllocator
    # Triton kernels (MLA buffers, last-location lookup) and the C++ page hash: unused here.
    mla = ("get_mla_kv_buffer_kernel get_mla_kv_buffer_triton set_mla_kv_buffer_dcp_sharded_triton "
           "set_mla_kv_buffer_fp8_quant_kernel set_mla_kv_buffer_kernel set_mla_kv_buffer_triton "
           "set_mla_kv_buffer_triton_fp8_quant set_mla_kv_scale_buffer_kernel set_mla_kv_scale_buffer_triton")
    _stub("sglang.kernels.ops.kvcache.mla_buffer", **{n: _unused(n) for n in mla.split()})
    _stub("sglang.kernels.ops.memory.common", _get_last_loc_safe_kernel=_unused("get_last_loc"),
          get_last_loc_kernel=_unused("get_last_loc"))  # fmt: skip
    _stub("sglang.srt.mem_cache.cpp_utils.native_hash", get_native_hash=_unused("get_native_hash"))
    # KV-event publishing (zmq, msgspec): the recorder is built disabled.
    _stub("sglang.srt.disaggregation.kv_events", **{n: _unused(n) for n in (
        "AllBlocksCleared", "BlockRemoved", "BlockStored", "StorageMedium", "kv_event_namespace_seed",
        "namespaced_block_hash")})  # fmt: skip
    # GPU pools and host memory: the benchmark brings its own row table and allocator.
    _stub("sglang.srt.mem_cache.memory_pool", ReqToTokenPool=object)
    _stub("sglang.srt.mem_cache.hicache_storage", PoolTransfer=object)
    # Logical-page sharding: our allocator is a stock one, for which SGLang's
    # page_interleave_shard_size returns 1.
    _stub("sglang.srt.mem_cache.allocator.page_interleave", page_interleave_shard_size=lambda allocator: 1)
    # Prometheus metrics: off (CacheInitParams.enable_metrics=False).
    _stub("sglang.srt.observability.metrics_collector", STAT_LOGGER_ROLE_RADIX_CACHE="radix_cache",
          RadixCacheMetricsCollector=object, radix_cache_metric_labels=_unused("metrics"),
          resolve_collector_class=_unused("metrics"))  # fmt: skip
    # The server's runtime context, at ServerArgs' defaults for what this path reads:
    # no speculative decoding, thinking tokens kept.
    serving = types.SimpleNamespace(strip_thinking_cache=False)
    spec = types.SimpleNamespace(speculative_algorithm=None)
    _stub("sglang.srt.runtime_context", get_serving=lambda: serving, get_spec=lambda: spec,
          get_observability=_unused("observability"), get_parallel=_unused("parallel"))  # fmt: skip

    _load(source, "sglang.srt.mem_cache.evict_policy", f"{_SRT}/mem_cache/evict_policy.py")
    _load(source, "sglang.srt.mem_cache.utils", f"{_SRT}/mem_cache/utils.py")
    _load(source, "sglang.srt.mem_cache.events", f"{_SRT}/mem_cache/events.py")
    _load(source, "sglang.srt.mem_cache.cache_init_params", f"{_SRT}/mem_cache/cache_init_params.py")
    base_prefix_cache = _load(source, "sglang.srt.mem_cache.base_prefix_cache", f"{_SRT}/mem_cache/base_prefix_cache.py")
    radix_cache = _load(source, "sglang.srt.mem_cache.radix_cache", f"{_SRT}/mem_cache/radix_cache.py")
    common = _load(source, "sglang.srt.mem_cache.common", f"{_SRT}/mem_cache/common.py")

    import dataclasses
    from typing import Optional

    import torch

    namespace = {"dataclasses": dataclasses, "Optional": Optional, "torch": torch, "array": array,
                 "ComponentType": component_type.ComponentType, "RetractionBackup": common.RetractionBackup,
                 "ceil_align": common_fns["ceil_align"], "get_serving": lambda: serving}  # fmt: skip
    batch = _definitions(source, f"{_SRT}/managers/schedule_batch.py", {
        "ReqKvInfo": None, "Req": ["refresh_fill_ids", "_compute_max_prefix_len", "owned_kv_len", "finished"]},
        namespace)  # fmt: skip
    dllm = _definitions(source, f"{_SRT}/dllm/mixin/req.py", {"ReqDllmMixin": ["is_dllm"]}, {})
    _LOADED = SGLang(source=source, radix_cache=radix_cache, common=common, base_prefix_cache=base_prefix_cache,
                     allocator_base=allocator_base, ReqKvInfo=batch["ReqKvInfo"],
                     req_methods={**batch["Req"], **dllm["ReqDllmMixin"]})  # fmt: skip
    return _LOADED


# -- the scheduler's side ----------------------------------------------------------------
def _allocator_class(sglang: SGLang):
    import torch

    class PageAllocator(sglang.allocator_base.BaseTokenToKVPoolAllocator):
        """A page-granular free list of Python ints handing out token slots (see the module
        docstring); SGLang's base class supplies the capacity hooks the scheduler calls."""

        def __init__(self, num_pages: int, page_size: int) -> None:
            super().__init__(num_pages * page_size, page_size, torch.int64, "cpu", None, False)
            self.num_pages = num_pages
            self.clear()

        def clear(self) -> None:
            self.free_pages = list(range(self.num_pages - 1, -1, -1))
            self.release_pages = []

        def available_size(self) -> int:
            return len(self.free_pages) * self.page_size

        def alloc_pages(self, n: int) -> list[int] | None:
            if n > len(self.free_pages):
                return None
            return [self.free_pages.pop() for _ in range(n)]

        def alloc(self, need_size: int):
            pages = self.alloc_pages(-(-need_size // self.page_size))
            if pages is None:
                return None
            return self.slots(pages)[:need_size]

        def slots(self, pages: list[int]):
            t = torch.tensor(pages, dtype=torch.int64)
            if self.page_size == 1:
                return t
            return (t[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)

        def free(self, free_index) -> None:
            """Token slots back; whole pages go back (SGLang frees KV indices)."""
            if free_index.numel() == 0:
                return
            if self.page_size == 1:
                self.free_pages += free_index.tolist()
            else:
                self.free_pages += sorted(set((free_index // self.page_size).tolist()))

    return PageAllocator


class _RowTable:
    """SGLang's ReqToTokenPool as the cache calls read it: one row of KV slots per live
    request (`req_to_token[idx, pos]`), `write`, `free`."""

    def __init__(self, rows: int, max_len: int) -> None:
        import torch

        self.req_to_token = torch.zeros((rows, max_len), dtype=torch.int64)
        self.free_rows = list(range(rows - 1, -1, -1))

    def alloc(self) -> int:
        return self.free_rows.pop()

    def write(self, index, values) -> None:
        self.req_to_token[index] = values

    def free(self, req) -> None:
        self.free_rows.append(req.kv.req_pool_idx)
        req.kv.req_pool_idx = None


class SGLangArm:
    """SGLang's RadixCache driven the way SGLang 0.5.23's scheduler drives it (see the
    module docstring): admit / commit / append / release, as the benchmark calls ours."""

    def __init__(self, sglang: SGLang, page_size: int, num_pages: int, eviction: str = "lru",
                 max_len: int = 1 << 15, rows: int = 8) -> None:  # fmt: skip
        params = sglang.radix_cache.CacheInitParams(
            disable=False,
            req_to_token_pool=_RowTable(rows, max_len),
            token_to_kv_pool_allocator=_allocator_class(sglang)(num_pages, page_size),
            page_size=page_size,
            eviction_policy=eviction,
        )
        self.sg = sglang
        self.tree = sglang.radix_cache.RadixCache(params)
        self.alloc = params.token_to_kv_pool_allocator
        self.rows = params.req_to_token_pool
        self.page = page_size
        self.reqs: dict[Any, Any] = {}
        self._req_class = self._make_req_class()

    def _make_req_class(self):
        sg = self.sg

        class Req:
            """The fields of SGLang's `Req` the cache calls read, and its own methods for them."""

            def __init__(self, rid, tokens: array, extra_key) -> None:
                self.rid = rid
                self.origin_input_ids = tokens
                self.output_ids = array("q")
                self.full_untruncated_fill_ids = array("q")
                self.extra_key = extra_key
                self.cache_salt = None
                self.priority = None
                self.kv = sg.ReqKvInfo()
                self.lock = None
                self.last_node = None
                self.prefix_len = 0
                self.extend_end = None
                self.finished_len = None
                self.finished_reason = None
                self.reasoning_tokens = 0
                self.skip_radix_cache_insert = False
                self.dllm_config = None
                self.return_logprob = False
                self.logprob_start_len = -1
                self.positional_embed_overrides = None

        for name, fn in sg.req_methods.items():
            setattr(Req, name, fn)
        return Req

    def admit(self, rid: Any, tokens: array, namespace: str | None = None) -> int | None:
        """Match, lock, allocate; the hit in tokens, or None if the prompt cannot fit."""
        import torch

        common = self.sg.common
        req = self._req_class(rid, tokens, namespace)
        # Req.init_next_round_input
        req.refresh_fill_ids()
        match = common.match_kv_cache(req, self.tree, req.full_untruncated_fill_ids,
                                      max_prefix_len=req._compute_max_prefix_len(len(req.full_untruncated_fill_ids)))  # fmt: skip
        if match.cache_protected_len is None:
            req.kv.cache_protected_len = req.prefix_len
        seq_len = len(tokens)
        need_pages = -(-seq_len // self.page) - req.prefix_len // self.page
        req.lock = self.tree.lock(req.last_node)  # PrefillAdder._commit_prefill_admission
        if need_pages * self.page > self.alloc.available_size() + self.tree.evictable_size():
            self.tree.unlock(req.lock)
            return None
        req.extend_end = seq_len
        # alloc_for_extend
        extend = seq_len - req.prefix_len
        if self.page == 1:
            demand = extend
        else:
            demand = self.alloc.get_extend_allocation_demand(
                torch.tensor([req.prefix_len]), torch.tensor([seq_len]),
                conservative_num_tokens=extend + self.page, shard_size=1)  # fmt: skip
        common.evict_from_tree_cache(self.tree, demand)
        pages = self.alloc.alloc_pages(need_pages)
        assert pages is not None, "the pool passed the room check but could not allocate"
        req.kv.req_pool_idx = self.rows.alloc()
        row = self.rows.req_to_token[req.kv.req_pool_idx]
        row[: req.prefix_len] = self.tree.prefix_device_indices(req)
        row[req.prefix_len : seq_len] = self.alloc.slots(pages)[:extend]
        req.kv.kv_allocated_len = req.kv.kv_committed_len = seq_len
        req.decode_slots = []
        req.last_prefill_slot = int(row[seq_len - 1])
        self.reqs[rid] = req
        return req.prefix_len

    def prefilled(self, rid: Any, sampled: int) -> None:
        """The prefill ran and sampled `sampled`; the running request is checkpointed."""
        req = self.reqs[rid]
        req.output_ids.append(sampled)
        self.sg.common.checkpoint_kv_cache(req, self.tree)

    def decode(self, rid: Any, token: int) -> None:
        """One decode step computing the KV of the request's newest token, `token` its output.

        The slot goes to the request's row when the cache next reads it (at release):
        SGLang writes a whole batch's decode slots with one tensor op, so the replay keeps
        them in a list rather than charging a tensor write per token to SGLang."""
        req = self.reqs[rid]
        kv = req.kv
        new_pages = 1 if kv.kv_committed_len % self.page == 0 else 0
        self.alloc.check_decode_capacity(num_tokens=new_pages * self.page, tree_cache=self.tree)  # check_decode_mem
        self.sg.common.evict_from_tree_cache(self.tree, self.page)  # alloc_for_decode: a page (a token) per request
        if new_pages:
            pages = self.alloc.alloc_pages(1)
            if pages is None:
                raise RuntimeError(f"request {rid}: no room to decode")
            slot = pages[0] * self.page
        else:
            slot = req.decode_slots[-1] + 1 if req.decode_slots else req.last_prefill_slot + 1
        req.decode_slots.append(slot)
        kv.kv_allocated_len += 1
        kv.kv_committed_len += 1
        req.output_ids.append(token)

    def release(self, rid: Any) -> None:
        """The request finished on its last sampled token (whose KV is never computed)."""
        import torch

        req = self.reqs.pop(rid)
        if req.decode_slots:
            end = req.kv.kv_allocated_len
            self.rows.req_to_token[req.kv.req_pool_idx, end - len(req.decode_slots) : end] = torch.tensor(
                req.decode_slots, dtype=torch.int64
            )
        req.finished_reason = "length"
        self.sg.common.release_kv_cache(req, self.tree, checkpoint=True)

    def check(self) -> None:
        """Every slot is the tree's or free once all requests are released."""
        assert not self.reqs
        assert self.tree.protected_size() == 0
        total = self.alloc.available_size() + self.tree.total_size()
        assert total == self.alloc.num_pages * self.page, (total, self.alloc.num_pages * self.page)
