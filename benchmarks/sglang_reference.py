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

import __future__
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
    # UnifiedRadixCache (FULL / SWA / MAMBA components) and what its path runs
    f"{_SRT}/utils/invariants.py",
    f"{_SRT}/mem_cache/hicache_storage.py",
    f"{_SRT}/mem_cache/storage_prefetch.py",
    f"{_SRT}/mem_cache/allocator/token.py",
    f"{_SRT}/mem_cache/allocator/paged.py",
    f"{_SRT}/mem_cache/allocator/swa.py",
    f"{_SRT}/mem_cache/allocator/mamba.py",
    f"{_SRT}/mem_cache/allocation.py",
    f"{_SRT}/mem_cache/memory_pool.py",
    f"{_SRT}/mem_cache/unified_cache/cache_action.py",
    f"{_SRT}/mem_cache/unified_cache/unified_tree_core_interface.py",
    f"{_SRT}/mem_cache/unified_cache/components/__init__.py",
    f"{_SRT}/mem_cache/unified_cache/components/base.py",
    f"{_SRT}/mem_cache/unified_cache/components/full.py",
    f"{_SRT}/mem_cache/unified_cache/components/swa.py",
    f"{_SRT}/mem_cache/unified_cache/components/mamba.py",
    f"{_SRT}/mem_cache/unified_cache/unified_tree_core.py",
    f"{_SRT}/mem_cache/unified_cache/tree_core_registry.py",
    f"{_SRT}/mem_cache/unified_cache/session_ref_tracker.py",
    f"{_SRT}/session/streaming_session.py",
    f"{_SRT}/mem_cache/unified_radix_cache.py",
    f"{_SRT}/runtime_context.py",
    f"{_SRT}/mem_cache/allocation_sizing.py",
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
        # Annotations stay strings (SGLang's files have `from __future__ import annotations`).
        code = compile(module, str(source.path(rel)), "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True)
        exec(code, namespace)  # noqa: S102 (SGLang's code, read-only)
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


# -- SGLang's UnifiedRadixCache (FULL / SWA / MAMBA components) -------------------------
class HybridRuntime(types.SimpleNamespace):
    """The server arguments SGLang's runtime context gives the unified cache's path, at
    SGLang 0.5.23's defaults for a model served with the extra_buffer Mamba strategy
    (overlap schedule on, not lazy) and no DCP: `page_size`, the model's `mamba_chunk`
    (FLA's 64 for Qwen3-Next) and `mamba_track_interval` (256). Set by each arm."""


_RUNTIME = HybridRuntime(page_size=1, mamba_chunk=64, mamba_track_interval=256)
_UNIFIED: SGLang | None = None


def load_sglang_unified(src: str | Path | None, cache_dir: str | Path) -> SGLang:
    """SGLang's UnifiedRadixCache with the Python TreeCore, its SWA and paged allocators,
    the Mamba slot allocator and request pools, and the scheduler functions around them
    (`allocation.py`, `common.py`, and `ScheduleBatch`'s SWA and Mamba-track methods),
    heavy imports stubbed. Raises SGLangUnavailable."""
    global _UNIFIED
    if _UNIFIED is not None:
        return _UNIFIED
    base = load_sglang(src, cache_dir)
    source = base.source
    import dataclasses
    import enum
    import math
    from typing import Any as _Any
    from typing import Callable, Dict, List, NamedTuple, Optional, Sequence

    import torch

    # Kernels, platforms and the KV tensors: CPU paths only (SGLang's naive allocator
    # kernels run when the platform says it has no Triton).
    _stub("sglang.srt.platforms", current_platform=types.SimpleNamespace(
        capabilities=types.SimpleNamespace(supports_triton=False), get_paged_allocator_cls=lambda: None,
        is_pin_memory_available=lambda device: False))  # fmt: skip
    _stub("sglang.kernels.ops.memory.allocator", alloc_decode_kernel=_unused("alloc_decode_kernel"),
          alloc_extend_kernel=_unused("alloc_extend_kernel"), get_and_clear_swa_pages=_unused("get_and_clear_swa_pages"))
    common_fns = _definitions(source, f"{_SRT}/utils/common.py", {
        "ceil_div": None, "ceil_align": None, "get_num_new_pages": None, "next_power_of_2": None}, {"torch": torch,
        "Optional": Optional, "List": List})  # fmt: skip
    utils_common = sys.modules["sglang.srt.utils.common"]
    utils_common.__dict__.update(common_fns, async_h2d=lambda args, *, dtype, device: torch.tensor(args, dtype=dtype),
                                 is_npu=lambda: False, is_pin_memory_available=lambda device=None: False)
    sys.modules["sglang.srt.utils"].__dict__.update(
        common_fns, get_bool_env_var=lambda name, default="false": False, is_hip=lambda: False, is_npu=lambda: False,
        is_cuda=lambda: False, is_cpu=lambda: True, is_xpu=lambda: False, support_triton=lambda backend: False)
    _load(source, "sglang.srt.utils.invariants", f"{_SRT}/utils/invariants.py")
    # KV events are off (the recorder is built disabled); the storage media are named.
    kv_events = sys.modules["sglang.srt.disaggregation.kv_events"]
    kv_events.StorageMedium = enum.Enum("StorageMedium", {"GPU": "GPU", "CPU": "CPU_PINNED"}, type=str)
    _stub("sglang.srt.distributed.communication_tags", P2PTag=object)
    _stub("sglang.srt.managers.cache_controller", CacheOperation=object)
    _stub("sglang.srt.mem_cache.buffer_mode")
    _stub("sglang.srt.mem_cache.buffer_mode.pipeline", BufferModePipeline=object,
          validate_buffer_only_stack=_unused("buffer-only host memory"))
    _stub("sglang.srt.mem_cache.buffer_mode.storage_existence_cache", PoolBeliefPolicy=object,
          StorageExistenceCache=lambda: types.SimpleNamespace(clear_inflight=lambda: None),
          default_belief_policy=_unused("storage beliefs"))  # fmt: skip
    _stub("sglang.srt.mem_cache.hybrid_cache")
    _stub("sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller", HybridCacheController=object,
          PPPrefetchDecision=object, PrefetchOperation=object)
    _stub("sglang.srt.mem_cache.swa_memory_pool", SWAKVPool=object)
    _stub("sglang.srt.mem_cache.unified_cache.storage_attachment", StorageAttachment=object)
    _stub("sglang.srt.mem_cache.unified_cache.unified_cache_linker", UnifiedCacheLinker=object,
          UnifiedCacheLinkerWrapper=object)
    metrics = sys.modules["sglang.srt.observability.metrics_collector"]
    metrics.StorageMetrics = metrics.StorageMetricsCollector = object
    _stub("sglang.srt.utils.poll_timer", PollTimer=object)
    _stub("sglang.srt.utils.rank_consensus_checker", rank_consensus=lambda *a, **k: (lambda fn: fn))
    _stub("sglang.srt.session")
    # DeepSeek V4's per-request SWA ring (the unified_kv gate): off for these models.
    for pkg in ("sglang.srt.layers", "sglang.srt.layers.attention", "sglang.srt.layers.attention.dsv4"):
        _stub(pkg)
    _stub("sglang.srt.layers.attention.dsv4.unified_kv_gate", is_unified_kv_triton=lambda: False)

    class BaseSWAKVPool:
        """SGLang's SWA KV pool as the allocator reads it: the full-to-SWA index mapping
        (the KV tensors themselves are not needed to decide hits)."""

        full_kv_pool = swa_kv_pool = swa_req_ring_size = None

        def register_mapping(self, mapping):
            self.full_to_swa_index_mapping = mapping

        def translate_loc_from_full_to_swa(self, kv_indices):  # SWAKVPool's: a lookup
            return self.full_to_swa_index_mapping[kv_indices]

    _stub("sglang.srt.mem_cache.base_swa_memory_pool", BaseSWAKVPool=BaseSWAKVPool)

    # The runtime context: defaults, and the arm's page size, Mamba chunk and interval.
    runtime = sys.modules["sglang.srt.runtime_context"]
    exec_bag = types.SimpleNamespace(mamba=types.SimpleNamespace(
        mamba_max_states_per_path=-1, enable_mamba_extra_buffer=True, enable_mamba_extra_buffer_lazy=False))
    runtime.get_exec = lambda: types.SimpleNamespace(mamba=types.SimpleNamespace(
        **vars(exec_bag.mamba), mamba_track_interval=_RUNTIME.mamba_track_interval))  # fmt: skip
    runtime.get_disagg = lambda: types.SimpleNamespace(disaggregation_mode="null",
                                                       disaggregation_decode_retraction_backup=None)
    runtime.get_parallel = lambda: types.SimpleNamespace(dcp_enabled=False, attn_dcp_size=1)
    runtime.get_memory = _unused("memory server arguments (HiCache, linkers)")
    runtime.get_model = _unused("model server arguments")
    # overrides.mamba_cache_chunk_size: max(the model's Mamba chunk, page_size).
    runtime.mamba_cache_chunk_size = lambda: max(_RUNTIME.mamba_chunk, _RUNTIME.page_size)
    runtime.__dict__.update(_definitions(source, f"{_SRT}/runtime_context.py", {
        "mamba_checkpoint_grid": None, "mamba_track_grid": None}, {**runtime.__dict__, "math": math}))  # fmt: skip

    _load(source, "sglang.srt.mem_cache.hicache_storage", f"{_SRT}/mem_cache/hicache_storage.py")
    _load(source, "sglang.srt.mem_cache.storage_prefetch", f"{_SRT}/mem_cache/storage_prefetch.py")
    alloc_pkg = sys.modules["sglang.srt.mem_cache.allocator"]
    for name, rel in (("token", "token.py"), ("paged", "paged.py"), ("swa", "swa.py"), ("mamba", "mamba.py")):
        _load(source, f"sglang.srt.mem_cache.allocator.{name}", f"{_SRT}/mem_cache/allocator/{rel}")
    alloc_pkg.TokenToKVPoolAllocator = sys.modules["sglang.srt.mem_cache.allocator.token"].TokenToKVPoolAllocator
    # DeepSeek V4's HiSparse allocator (the SWA component accepts it too): not this path.
    _stub("sglang.srt.mem_cache.allocator.hisparse", DeepSeekV4HiSparseTokenToKVPoolAllocator=type("Unused", (), {}))
    # The unified (shared-pool) SWA allocator: these arms run SGLang's static SWA pools.
    _stub("sglang.srt.mem_cache.allocator.unified_hybrid_swa", UnifiedSWAAllocatorBase=type("Unused", (), {}))

    # Request pools: SGLang's ReqToTokenPool and HybridReqToTokenPool classes, whole,
    # from memory_pool.py (constructed through `make_req_pool`, which skips the GPU
    # state tensors their constructors allocate).
    sizing = _definitions(source, f"{_SRT}/mem_cache/allocation_sizing.py", {"get_mamba_tracking_slots": None}, {})
    pool_ns: dict = {"torch": torch, "Optional": Optional, "List": List, "Callable": Callable, "Any": _Any,
                     "async_h2d": utils_common.async_h2d, "_MAMBA_DEBUG_ASSERTS": False, "MambaPool": object,
                     "logger": types.SimpleNamespace(info=lambda *a, **k: None), **sizing}  # fmt: skip
    pools = _definitions(source, f"{_SRT}/mem_cache/memory_pool.py", {"ReqToTokenPool": None}, pool_ns)
    pools.update(_definitions(source, f"{_SRT}/mem_cache/memory_pool.py", {"HybridReqToTokenPool": None}, pool_ns))
    memory_pool = sys.modules["sglang.srt.mem_cache.memory_pool"]
    memory_pool.ReqToTokenPool = pools["ReqToTokenPool"]
    memory_pool.HybridReqToTokenPool = pools["HybridReqToTokenPool"]
    memory_pool.MHATokenToKVPool = object

    uc = "sglang.srt.mem_cache.unified_cache"
    for name in ("cache_action", "unified_tree_core_interface"):
        _load(source, f"{uc}.{name}", f"{_SRT}/mem_cache/unified_cache/{name}.py")
    _stub(f"{uc}.components")
    for name in ("base", "full", "swa", "mamba"):
        _load(source, f"{uc}.components.{name}", f"{_SRT}/mem_cache/unified_cache/components/{name}.py")
    components = _load(source, f"{uc}.components", f"{_SRT}/mem_cache/unified_cache/components/__init__.py")
    tree_core = _load(source, f"{uc}.unified_tree_core", f"{_SRT}/mem_cache/unified_cache/unified_tree_core.py")
    _load(source, f"{uc}.tree_core_registry", f"{_SRT}/mem_cache/unified_cache/tree_core_registry.py")
    _load(source, f"{uc}.session_ref_tracker", f"{_SRT}/mem_cache/unified_cache/session_ref_tracker.py")
    sys.modules["sglang.srt.managers.schedule_batch"] = types.ModuleType("sglang.srt.managers.schedule_batch")
    sys.modules["sglang.srt.managers.schedule_batch"].ReqKvInfo = base.ReqKvInfo
    _load(source, "sglang.srt.session.streaming_session", f"{_SRT}/session/streaming_session.py")
    unified = _load(source, "sglang.srt.mem_cache.unified_radix_cache", f"{_SRT}/mem_cache/unified_radix_cache.py")

    # The scheduler's side: allocation.py's functions (its Triton kernels unused on CPU)
    # and ScheduleBatch's SWA-eviction and Mamba-track methods, run on a one-request batch.
    common = base.common
    sched_ns: dict = {"torch": torch, "Optional": Optional, "List": List, "NamedTuple": NamedTuple, "BasePrefixCache": object,
                      "EvictParams": sys.modules["sglang.srt.mem_cache.base_prefix_cache"].EvictParams,
                      "HybridReqToTokenPool": pools["HybridReqToTokenPool"], "ReqToTokenPool": pools["ReqToTokenPool"],
                      "evict_from_tree_cache": common.evict_from_tree_cache,
                      "available_and_evictable_str": common.available_and_evictable_str,
                      "page_interleave_shard_size": lambda allocator: 1, "logger": types.SimpleNamespace(
                          error=lambda *a, **k: None), "envs": sys.modules["sglang.srt.environ"].envs,
                      "ComponentType": sys.modules[f"{uc}.component_type"].ComponentType, "_is_hip": False,
                      "mamba_cache_chunk_size": runtime.mamba_cache_chunk_size,
                      "mamba_checkpoint_grid": runtime.mamba_checkpoint_grid, "get_parallel": runtime.get_parallel,
                      "get_exec": runtime.get_exec}  # fmt: skip
    allocation = _definitions(source, f"{_SRT}/mem_cache/allocation.py", {
        "alloc_token_slots": None, "alloc_paged_token_slots_extend": None, "alloc_paged_token_slots_decode": None,
        "ensure_mamba_capacity": None, "alloc_req_slots": None}, sched_ns)  # fmt: skip
    batch_src = f"{_SRT}/managers/schedule_batch.py"
    sched_ns.update(_definitions(source, batch_src, {"_MambaRadixCacheV2TrackEntry": None}, sched_ns))
    batch_methods = _definitions(source, batch_src, {"ScheduleBatch": [
        "maybe_evict_swa", "_swa_eviction_trigger", "_evict_swa", "_mamba_radix_cache_v2_req_prepare_for_extend"]},
        sched_ns)["ScheduleBatch"]  # fmt: skip
    req_methods = _definitions(source, batch_src, {"Req": ["seqlen", "get_fill_ids", "extend_len"]}, sched_ns)["Req"]
    _UNIFIED = SGLang(source=source, base=base, unified=unified, tree_core=tree_core, components=components,
                      allocators=alloc_pkg, pools=pools, allocation=allocation, batch_methods=batch_methods,
                      req_methods={**base.req_methods, **req_methods}, runtime=runtime,
                      base_prefix_cache=sys.modules["sglang.srt.mem_cache.base_prefix_cache"])  # fmt: skip
    return _UNIFIED


class SGLangHybridArm:
    """SGLang 0.5.23's UnifiedRadixCache over full + SWA or full + Mamba components,
    driven as its scheduler drives it, one request at a time (prefill unchunked,
    requests at priority None, no speculative decoding):

    - admission (`Req.init_next_round_input`, `PrefillAdder`, `prepare_for_extend`):
      `match_kv_cache` on the prompt (limit `_compute_max_prefix_len`, copy-on-write of
      the matched Mamba state), `req.lock = tree_cache.lock(req.last_node)`, then
      `alloc_for_extend`: `maybe_evict_swa`, `alloc_req_slots` (the Mamba running slot
      and ping-pong track slots, evicting for them) and the extend's KV slots
      (`alloc_paged_token_slots_extend` / `alloc_token_slots`, evicting the allocator's
      demand); with Mamba, `_mamba_radix_cache_v2_req_prepare_for_extend` picks the
      state the extend tracks (the branching point or the last chunk-aligned position);
    - after the prefill: `checkpoint_kv_cache` (insert up to what the components allow);
    - each decode step: `check_decode_mem`, `alloc_for_decode` (its `maybe_evict_swa`,
      then a page of room and a slot), then, on a step that lands on the Mamba track
      interval, the result processor's track update (the non-overlapped order: the
      step's state is the one tracked);
    - finish: `release_kv_cache(req, tree_cache, checkpoint=True)`.

    Pool sizes are SGLang's separate pools: `full_pages` of `page_size` tokens,
    `swa_pages` for the SWA pool, `mamba_slots` state slots. `window` is the model's
    sliding window in TOKENS a query attends to, itself included (Hugging Face's
    `sliding_window`); SGLang's `sliding_window_size` is one less (gpt-oss, Gemma 3).
    """

    def __init__(self, sglang: SGLang, page_size: int, full_pages: int, *, window: int | None = None,
                 swa_pages: int = 0, mamba_slots: int = 0, mamba_chunk: int = 64, mamba_track_interval: int = 256,
                 chunked_prefill_size: int = 0, max_len: int = 1 << 14, rows: int = 16) -> None:  # fmt: skip
        import torch

        _RUNTIME.page_size, _RUNTIME.mamba_chunk = page_size, mamba_chunk
        _RUNTIME.mamba_track_interval = mamba_track_interval
        sg = sglang
        ct = sys.modules["sglang.srt.mem_cache.unified_cache.component_type"].ComponentType
        kinds = [ct.FULL] + ([ct.SWA] if window else []) + ([ct.MAMBA] if mamba_slots else [])
        alloc_mods = sg.allocators
        if window:
            kvcache = sys.modules["sglang.srt.mem_cache.base_swa_memory_pool"].BaseSWAKVPool()
            allocator = sys.modules["sglang.srt.mem_cache.allocator.swa"].SWATokenToKVPoolAllocator(
                full_pages * page_size, swa_pages * page_size, page_size, torch.int64, "cpu", kvcache, False)
        elif page_size > 1:
            allocator = sys.modules["sglang.srt.mem_cache.allocator.paged"].PagedTokenToKVPoolAllocator(
                full_pages * page_size, page_size, torch.int64, "cpu", None, False)
        else:
            allocator = alloc_mods.TokenToKVPoolAllocator(full_pages, torch.int64, "cpu", None, False)
        pool = self._req_pool(sg, rows, max_len, mamba_slots)
        params = sg.base.radix_cache.CacheInitParams(
            disable=False, req_to_token_pool=pool, token_to_kv_pool_allocator=allocator, page_size=page_size,
            eviction_policy="lru", enable_mamba_extra_buffer=bool(mamba_slots),
            sliding_window_size=window - 1 if window else None, tree_components=tuple(kinds),
            tree_core_backend="python")  # fmt: skip
        self.sg = sg
        self.tree = sg.unified.UnifiedRadixCache(params)
        self.alloc = allocator
        self.pool = pool
        self.page = page_size
        self.mamba = bool(mamba_slots)
        self.track_grid = sg.runtime.mamba_track_grid(page_size) if self.mamba else 0
        self.mamba_chunk = mamba_chunk
        self.chunked_prefill_size = chunked_prefill_size
        self.reqs: dict[Any, Any] = {}
        self._req_class = self._make_req_class()
        self._batch_class = self._make_batch_class()

    @staticmethod
    def _req_pool(sg: SGLang, rows: int, max_len: int, mamba_slots: int):
        """SGLang's ReqToTokenPool (HybridReqToTokenPool with Mamba) with the fields its
        constructor sets, minus the GPU state tensors (the hits never read a state)."""
        import torch

        cls = sg.pools["HybridReqToTokenPool" if mamba_slots else "ReqToTokenPool"]
        pool = object.__new__(cls)
        pool.size, pool._alloc_size, pool.max_context_len, pool.device = rows, rows + 1, max_len, "cpu"
        pool.req_to_token = torch.zeros((rows + 1, max_len), dtype=torch.int64)
        pool.free_slots = list(range(1, rows + 1))
        pool.req_generation = torch.zeros(rows + 1, dtype=torch.int64)
        pool._aux_cache = None
        if mamba_slots:
            slots_cls = sys.modules["sglang.srt.mem_cache.allocator.mamba"].MambaSlotAllocator
            # get_mamba_tracking_slots(extra_buffer=True, overlap=True): two ping-pong slots.
            pool.mamba_ping_pong_track_buffer_size = pool.mamba_initial_tracking_slots = 2
            pool.enable_mamba_extra_buffer, pool.enable_mamba_extra_buffer_lazy = True, False
            pool.mamba_allocator = slots_cls(mamba_slots, "cpu")
            pool.mamba_pool = types.SimpleNamespace(replayssm_spec_write_pos=None, replayssm_write_pos=None,
                                                    copy_from=lambda src, dst: None)  # no state tensors
            pool.mamba_ckpt_pool = None
            pool.req_index_to_mamba_index_mapping = torch.zeros(rows + 1, dtype=torch.int32)
            pool.req_index_to_mamba_ping_pong_track_buffer_mapping = torch.zeros((rows + 1, 2), dtype=torch.int64)
        return pool

    def _make_req_class(self):
        sg = self.sg

        class Req:
            """The fields of SGLang's `Req` the cache and scheduler calls read, and its methods for them."""

            def __init__(self, rid, tokens: array, extra_key) -> None:
                self.rid = rid
                self.origin_input_ids = tokens
                self.output_ids = array("q")
                self.full_untruncated_fill_ids = array("q")
                self.extra_key = extra_key
                self.cache_salt = self.priority = self.session = self.session_id = self.kv_rotation_base = None
                self.kv = sg.base.ReqKvInfo()
                self.lock = self.last_node = self.extend_end = self.finished_len = self.finished_reason = None
                self.swa_branching_seqlen = self.mamba_branching_seqlen = self.to_finish = None
                self.prefix_len = self.reasoning_tokens = self.decode_batch_idx = 0
                self.skip_radix_cache_insert = self.return_logprob = False
                self.dllm_config = self.positional_embed_overrides = None
                self.logprob_start_len = -1

        for name, fn in sg.req_methods.items():
            setattr(Req, name, fn)
        return Req

    def _make_batch_class(self):
        arm = self

        class Batch:
            """A one-request ScheduleBatch, as far as its SWA and Mamba-track methods read it."""

            def __init__(self, reqs, mode: str) -> None:
                self.reqs = reqs
                self.tree_cache = arm.tree
                self.token_to_kv_pool_allocator = arm.alloc
                self.req_to_token_pool = arm.pool
                self.forward_mode = types.SimpleNamespace(is_decode=lambda: mode == "decode",
                                                          is_extend=lambda: mode == "extend")
                self.prefix_lens = [r.prefix_len for r in reqs]
                self.enable_overlap = True
                self.forward_iter = 0
                self.model_config = types.SimpleNamespace(
                    hf_text_config=types.SimpleNamespace(mamba_chunk_size=arm.mamba_chunk))

        for name, fn in self.sg.batch_methods.items():
            setattr(Batch, name, fn)
        return Batch

    # -- the scheduler's calls ----------------------------------------------------------
    def _chunk_end(self, req, first: bool) -> int:
        """Where the next extend ends: PrefillAdder's cut with its budget to spare
        (`_select_prefill_admission` for the first, `add_chunked_req` for the next)."""
        size, page, n = self.chunked_prefill_size, self.page, len(req.full_untruncated_fill_ids)
        if first:
            if not size or -(-(n - req.prefix_len) // page) * page <= size:
                return n
            return (req.prefix_len + size // page * page) // page * page
        return req.prefix_len + min(n - req.prefix_len, size)

    def _extend(self, req) -> int | None:
        """alloc_for_extend of [prefix_len, extend_end) and the Mamba state the extend
        tracks (`_mamba_radix_cache_v2_req_prepare_for_extend`): its position or None."""
        import torch

        allocation = self.sg.allocation
        seq_len = req.extend_end
        batch = self._batch_class([req], "extend")
        batch.maybe_evict_swa()
        if req.kv.holds_kv:  # a later chunk: its prefix is in its row
            prefix = self.pool.req_to_token[req.kv.req_pool_idx][: req.prefix_len].clone()
        elif req.prefix_len:
            prefix = self.tree.prefix_device_indices(req)
        else:
            prefix = torch.empty((0,), dtype=torch.int64)
        allocation["alloc_req_slots"](self.pool, [req], self.tree)
        extend = seq_len - req.prefix_len
        if self.page == 1:
            out = allocation["alloc_token_slots"](self.tree, extend)
        else:
            lens = torch.tensor([req.prefix_len]), torch.tensor([seq_len])
            last = prefix[-1:] if len(prefix) else torch.tensor([-1])
            out = allocation["alloc_paged_token_slots_extend"](
                self.tree, lens[0], lens[0], lens[1], lens[1], last, extend, batch=batch)  # fmt: skip
        row = self.pool.req_to_token[req.kv.req_pool_idx]
        row[: req.prefix_len] = prefix
        row[req.prefix_len : seq_len] = out
        req.kv.kv_allocated_len = req.kv.kv_committed_len = seq_len
        if not self.mamba:
            return None
        entry = batch._mamba_radix_cache_v2_req_prepare_for_extend(req)
        return req.kv.mamba_last_track_seqlen if entry.track_mask else None

    def admit(self, rid: Any, tokens: array, namespace: str | None = None) -> tuple[int, int | None]:
        """Match, lock, allocate the first extend; the hit in tokens and the position
        that extend tracks a Mamba state at (None if none)."""
        common = self.sg.base.common
        req = self._req_class(rid, tokens, namespace)
        # Req.init_next_round_input
        req.refresh_fill_ids()
        fill = req.full_untruncated_fill_ids
        match = common.match_kv_cache(req, self.tree, fill, cow_mamba=self.tree.supports_mamba(),
                                      max_prefix_len=req._compute_max_prefix_len(len(fill)))  # fmt: skip
        req.mamba_branching_seqlen = match.mamba_branching_seqlen
        if match.cache_protected_len is None:
            req.kv.cache_protected_len = req.prefix_len
        req.lock = self.tree.lock(req.last_node)  # PrefillAdder._commit_prefill_admission
        req.extend_end = self._chunk_end(req, first=True)
        track = self._extend(req)
        self.reqs[rid] = req
        return req.prefix_len, track

    def advance(self, rid: Any) -> list[int]:
        """The prefill's chunks run up to the last one's allocation: each stashed
        (`stash_chunked_request`) before the next is allocated. Returns each later
        chunk's start and the position it tracks a Mamba state at (TOKENS, in order)."""
        req = self.reqs[rid]
        positions = []
        while req.extend_end < len(req.full_untruncated_fill_ids):
            self.sg.base.common.checkpoint_kv_cache(req, self.tree)  # prefix_len = extend_end
            positions.append(req.prefix_len)
            req.refresh_fill_ids()  # init_next_round_input() without a tree: not matched again
            req.extend_end = self._chunk_end(req, first=False)
            track = self._extend(req)
            if track is not None:
                positions.append(track)
        return positions

    def prefilled(self, rid: Any, sampled: int) -> list[int]:
        """The prefill runs its remaining chunks (`advance`) and samples `sampled`; the
        running request is checkpointed. Returns what `advance` did."""
        positions = self.advance(rid)
        req = self.reqs[rid]
        req.output_ids.append(sampled)
        self.sg.base.common.checkpoint_kv_cache(req, self.tree)
        return positions

    def decode(self, rid: Any, token: int) -> None:
        """One decode step computing the KV of the request's newest token; `token` is what it samples."""
        import torch

        req = self.reqs[rid]
        kv = req.kv
        seq_len = kv.kv_committed_len
        new_pages = 1 if seq_len % self.page == 0 else 0
        self.alloc.check_decode_capacity(num_tokens=new_pages * self.page, tree_cache=self.tree)  # check_decode_mem
        # prepare_for_decode -> alloc_for_decode_default
        self._batch_class([req], "decode").maybe_evict_swa()
        row = self.pool.req_to_token[kv.req_pool_idx]
        if self.page == 1:
            out = self.sg.allocation["alloc_token_slots"](self.tree, 1)
        else:
            out = self.sg.allocation["alloc_paged_token_slots_decode"](
                self.tree, torch.tensor([seq_len + 1]), torch.tensor([seq_len + 1]), row[seq_len - 1 : seq_len])
        row[seq_len] = out[0]
        kv.kv_allocated_len += 1
        kv.kv_committed_len += 1
        req.decode_batch_idx += 1
        if self.mamba and (seq_len + 1) % self.track_grid == 0:
            # The result processor at a completed track boundary (non-lazy, lookahead 0).
            track_idx = kv.mamba_next_track_idx
            kv.mamba_last_track_idx = track_idx
            kv.mamba_prev_track_seqlen = kv.mamba_last_track_seqlen
            kv.mamba_last_track_seqlen = kv.kv_committed_len
            kv.mamba_next_track_idx = self.pool.get_mamba_ping_pong_other_idx(track_idx)
        req.output_ids.append(token)

    def release(self, rid: Any) -> None:
        """The request finished on its last sampled token (whose KV is never computed)."""
        req = self.reqs.pop(rid)
        req.finished_reason = "length"
        self.sg.base.common.release_kv_cache(req, self.tree, checkpoint=True)

    def check(self) -> None:
        """Once every request is released nothing is locked and every slot is free or the tree's."""
        assert not self.reqs
        self.tree.sanity_check()
