"""vLLM 0.33's own KV cache manager, imported on a CPU-only machine for side-by-side runs.

Owns getting vLLM's pure-Python `vllm/v1/core` modules into this process without
installing vLLM: download the wheel once (`pip download vllm==0.33.0 --no-deps`, about
336 MB) into a cache directory, extract only the modules the manager runs, and import
them with stand-ins for everything else they import (CUDA platform code, multimodal,
LoRA, metrics, KV connectors, torch), none of which the single full-attention group,
no-connector path used here executes.

Must never: be imported by the library or the tests, or be committed with vLLM's code
(the cache directory lives outside the repository). What runs is vLLM's unmodified
source; the stand-ins with behaviour are `Request`, a data holder that hashes its
blocks with vLLM's own `get_request_block_hasher` exactly as vLLM's
`Request.update_block_hashes` does, and the KV event types (plain dataclasses with the
fields of vLLM's msgspec structs, which live beside a ZeroMQ publisher). With
`load(..., real_events=True)` the event types are vLLM's own as well: its
`vllm/distributed/kv_events.py` (msgspec structs, `ZmqEventPublisher`) and
`vllm/config/kv_events.py` run unmodified, which needs pyzmq and msgspec installed.
"""

from __future__ import annotations

import enum
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import subprocess
import sys
import types
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VERSION = "0.33.0"

# vLLM modules executed for real, as shipped in the wheel.
REAL_MODULES = (
    "vllm.v1.core.kv_cache_manager",
    "vllm.v1.core.kv_cache_coordinator",
    "vllm.v1.core.single_type_kv_cache_manager",
    "vllm.v1.core.block_pool",
    "vllm.v1.core.kv_cache_utils",
    "vllm.v1.core.kv_cache_metrics",
    "vllm.v1.kv_cache_interface",
    "vllm.v1.kv_cache_spec_registry",
    "vllm.v1.kv_cache_layout",
    "vllm.utils.math_utils",
    "vllm.utils.hashing",
)
# With real_events: vLLM's KV event structs, its ZeroMQ publisher and their config.
EVENT_MODULES = ("vllm.distributed.kv_events", "vllm.config.kv_events")
# Read, never imported (it needs the whole engine): the scheduler's one method that
# splits a Mamba prefill, executed alone by `mamba_split` (hybrid layouts).
SCHEDULER_FILE = "vllm/v1/core/sched/scheduler.py"


class _StubMeta(type):
    """A stand-in that absorbs what module-level code does with an import: attribute
    access, calls, subscripts, `|` in annotations, use as a base class or decorator."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubMeta(name, (_Stub,), {})

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]  # used as a decorator: leave the decorated object alone
        return _StubMeta(cls.__name__, (_Stub,), {})

    def __getitem__(cls, item: Any) -> Any:
        return cls

    def __or__(cls, other: Any) -> Any:
        return cls

    __ror__ = __or__

    def __iter__(cls) -> Any:
        return iter(())

    def __bool__(cls) -> bool:
        return False


class _Stub(metaclass=_StubMeta):
    pass


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        submodule = f"{self.__name__}.{name}"
        if submodule in _real or submodule in SHIMS:  # `from vllm import envs`
            return importlib.import_module(submodule)
        value = _StubMeta(name, (_Stub,), {})
        setattr(self, name, value)
        return value


class RequestStatus(enum.IntEnum):
    WAITING = 1
    RUNNING = 2
    PREEMPTED = 3


class Request:
    """The fields of vLLM's `Request` that `vllm/v1/core` reads, and its hashing."""

    def __init__(self, request_id: str, prompt: list[int], block_hasher: Any, cache_salt: str | None = None):
        self.request_id = request_id
        self.status = RequestStatus.WAITING
        self.prompt_token_ids = prompt
        self._all_token_ids = list(prompt)
        self.all_token_ids = self._all_token_ids
        self.num_prompt_tokens = len(prompt)
        self.num_computed_tokens = 0
        self.num_in_flight_tokens = 0
        self.num_preemptions = 0
        self.cache_salt = cache_salt
        self.mm_features: list = []
        self.lora_request = None
        self.prompt_embeds = None
        self.session_id = None
        self.shared_prefix_boundary = 0
        self.skip_reading_prefix_cache = False
        self.kv_cache_report_mode = "incremental"
        self.block_hashes: list[bytes] = []
        self._block_hasher = block_hasher
        self.update_block_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self._all_token_ids.extend(token_ids)
        self.update_block_hashes()

    def update_block_hashes(self) -> None:
        self.block_hashes.extend(self._block_hasher(self))


# vLLM's KV event types are msgspec Structs in a module that also imports ZeroMQ;
# these carry the same fields, filled in by vLLM's own block pool.
@dataclass(kw_only=True)
class KVCacheEvent:
    pass


@dataclass(kw_only=True)
class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list | None = None


@dataclass(kw_only=True)
class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclass(kw_only=True)
class AllBlocksCleared(KVCacheEvent):
    medium: str | None = None


def _shim(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


SHIMS = {
    "vllm.logger": dict(init_logger=logging.getLogger),
    "vllm.envs": dict(VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=False),
    "vllm.v1.request": dict(Request=Request, RequestStatus=RequestStatus),
    "vllm.distributed.kv_events": dict(
        KVCacheEvent=KVCacheEvent,
        BlockStored=BlockStored,
        BlockRemoved=BlockRemoved,
        AllBlocksCleared=AllBlocksCleared,
        MEDIUM_GPU="GPU",
        MEDIUM_CPU="CPU",
    ),
}


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """vllm.* and torch: real modules from `root`, shims, else stand-ins."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name.split(".")[0] not in ("vllm", "torch"):
            return None
        if name in _real:
            return importlib.util.spec_from_file_location(name, self.root / (name.replace(".", "/") + ".py"))
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        if spec.name in SHIMS:
            return _shim(spec.name, **SHIMS[spec.name])
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


# The modules executed for real in this process (REAL_MODULES, + EVENT_MODULES with real_events).
_real: set[str] = set(REAL_MODULES)
# (sources, real_events) of the import made in this process, if any.
_loaded_from: tuple[Path, bool] | None = None


def _install(src: Path, real_events: bool) -> None:
    """Put vLLM's modules from `src` (with stand-ins) on the import path, once."""
    global _loaded_from
    if real_events:
        _real.update(EVENT_MODULES)
        SHIMS.pop("vllm.distributed.kv_events")
        SHIMS["vllm.envs"] = dict(VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=True)
        SHIMS["vllm.config.utils"] = dict(config=dataclass)  # vLLM's @config: a dataclass
    sys.meta_path.insert(0, _Finder(src))
    _loaded_from = (src, real_events)


def fetch(cache_dir: Path) -> Path:
    """The extracted sources under cache_dir/src, downloading the wheel on first use."""
    src = cache_dir / "src"
    modules = REAL_MODULES + EVENT_MODULES
    files = [m.replace(".", "/") + ".py" for m in modules] + [SCHEDULER_FILE]
    if all((src / f).is_file() for f in files):
        return src
    cache_dir.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache_dir.glob(f"vllm-{VERSION}-*.whl"))
    if not wheels:
        print(f"downloading vllm=={VERSION} (~336 MB) into {cache_dir} ...", file=sys.stderr)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", f"vllm=={VERSION}", "--no-deps", "-d", str(cache_dir)],
            check=True,
        )
        wheels = sorted(cache_dir.glob(f"vllm-{VERSION}-*.whl"))
    with zipfile.ZipFile(wheels[0]) as wheel:
        for name in files:
            wheel.extract(name, src)
    return src


@dataclass
class VllmCore:
    """What a side-by-side run needs from vLLM. `make_hybrid_manager` and `mamba_split`
    serve hybrid layouts (`make_hybrid_manager`'s docstring)."""

    KVCacheManager: type
    Request: type
    block_hasher: Any
    make_manager: Any
    make_hybrid_manager: Any = None
    mamba_split: Any = None


def load(cache_dir: Path, block_size: int, *, real_events: bool = False) -> VllmCore:
    """Import vLLM's v1/core from `cache_dir` (see the module docstring); with
    `real_events`, vLLM's own KV event module too (vLLM's default int block hashes)."""
    src = fetch(cache_dir)
    if _loaded_from is not None and _loaded_from == (src, real_events):
        pass  # already imported from here by an earlier load (another block size)
    elif any(name == "vllm" or name.startswith("vllm.") for name in sys.modules):
        raise RuntimeError("a vllm package is already imported in this process")
    elif "torch" in sys.modules:
        raise RuntimeError("import this before torch: vLLM's torch imports are stood in for")
    else:
        _install(src, real_events)

    from vllm.utils.hashing import sha256_cbor
    from vllm.v1 import kv_cache_interface as kci
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    kv_cache_utils.init_none_hash(sha256_cbor)
    hasher = kv_cache_utils.get_request_block_hasher(block_size, sha256_cbor)

    def make_manager(num_blocks: int, enable_events: bool = False) -> Any:
        """vLLM's manager over `num_blocks` blocks (one of them its null block)."""
        spec = kci.FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=None)
        group = kci.KVCacheGroupSpec(["layer"], spec)
        config = kci.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[group])
        return KVCacheManager(
            config,
            max_model_len=1 << 22,
            scheduler_block_size=block_size,
            hash_block_size=block_size,
            enable_caching=True,
            enable_kv_cache_events=enable_events,
        )

    def make_hybrid_manager(
        groups: list[tuple[str, int | None, int | None]],
        num_blocks: int,
        enable_events: bool = False,
        retention_interval: int | None = 0,
    ) -> Any:
        """vLLM's manager over a hybrid `KVCacheConfig`: one group per `(kind, window,
        chunk)` in order (kinds `full_attention`, `sliding_window` with its window,
        `chunked_local_attention` with its chunk, `mamba`), every group at `block_size`
        (so the hash block, the scheduler block and each group's block are one), Mamba
        in "align" mode (what prefix caching needs), `prefix_cache_retention_interval`
        at vLLM's default 0, and `num_blocks` blocks (one of them the null block)."""
        specs = []
        for kind, window, chunk in groups:
            attn = dict(block_size=block_size, num_kv_heads=1, head_size=1, dtype=None)
            if kind == "full_attention":
                specs.append(kci.FullAttentionSpec(**attn))
            elif kind == "sliding_window":
                specs.append(kci.SlidingWindowSpec(**attn, sliding_window=window))
            elif kind == "chunked_local_attention":
                specs.append(kci.ChunkedLocalAttentionSpec(**attn, attention_chunk_size=chunk))
            elif kind == "mamba":
                specs.append(kci.MambaSpec(block_size=block_size, shapes=((1,),), dtypes=(None,), mamba_cache_mode="align"))
            else:
                raise ValueError(f"unknown kind {kind!r}")
        config = kci.KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[kci.KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(specs)],
            prefix_cache_retention_interval=retention_interval,
        )
        return KVCacheManager(
            config,
            max_model_len=1 << 22,
            scheduler_block_size=block_size,
            hash_block_size=block_size,
            enable_caching=True,
            enable_kv_cache_events=enable_events,
        )

    split = _scheduler_method(src, "_mamba_block_aligned_split", kci)
    scheduler = types.SimpleNamespace(
        cache_config=types.SimpleNamespace(block_size=block_size),
        block_size=block_size,
        hash_block_size=block_size,
        mamba_partial_cache_hit=False,  # hash block = block
        use_eagle_block_drop=False,
        num_hash_lookahead_tokens=0,
        mamba_has_prefill_checkpoint_blocks=False,  # MambaSpec default: no prefill-checkpoint blocks
        mamba_prefill_checkpoint_alignment=None,
        mamba_shared_prefix_checkpoint=False,  # vLLM's default
        max_num_scheduled_tokens=1 << 30,  # an unbounded step: every chunk end is a split's
        scheduler_config=types.SimpleNamespace(long_prefill_token_threshold=0),
    )

    def mamba_split(request: Any, num_new_tokens: int, num_new_local_computed_tokens: int = 0) -> int:
        """vLLM's scheduler clipping a Mamba prefill chunk (`Scheduler._mamba_block_aligned_split`,
        its own code) for a scheduler at the defaults above; returns the chunk's tokens."""
        return split(scheduler, request, num_new_tokens, num_new_local_computed_tokens)

    return VllmCore(KVCacheManager, Request, hasher, make_manager, make_hybrid_manager, mamba_split)


def _scheduler_method(src: Path, name: str, kci: Any) -> Any:
    """One method of vLLM's `Scheduler`, compiled alone from its source file with the
    names it reads (it is never imported: the module needs the whole engine)."""
    import ast

    path = src / SCHEDULER_FILE
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "Scheduler":
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    item.decorator_list = []
                    item.returns = None
                    for arg in item.args.args + item.args.kwonlyargs:
                        arg.annotation = None
                    namespace = {
                        "get_mamba_prefill_checkpoint_position": kci.get_mamba_prefill_checkpoint_position,
                        "is_mamba_prefill_checkpoint_valid": kci.is_mamba_prefill_checkpoint_valid,
                    }
                    exec(compile(ast.Module(body=[item], type_ignores=[]), str(path), "exec"), namespace)  # noqa: S102
                    return namespace[name]
    raise RuntimeError(f"{path} has no Scheduler.{name}")
