"""Namespaces: salts and LoRA adapters, tagged so that no two sources of isolation collide.

Golden digests with an adapter were computed by vLLM 0.33.0's own
`kv_cache_utils.get_request_block_hasher` (sha256_cbor, block size 16, tokens 0..31)
on a request whose `lora_request` had lora_name "math" and lora_path "/adapters/math".
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import prefixcache
from prefixcache import BlockStored
from prefixcache.config import CacheConfig, HashConfig
from prefixcache.hashing import block_hashes, chain_hashes, none_hash, reference_chain_hashes
from prefixcache.isolation import Isolation, LoRA, check_namespace, exact_bytes, exact_key, extra_keys

MATH = LoRA("math", "/adapters/math")

GOLDEN_LORA = [
    "6490918a0c5efe6a6ed7ae90e86240c69678643ea5d98909c0c087bc2d405eca",
    "fcf03ffbd083141276fa2a09457aa3c5a42a38ebe67991e9fdcfe2d9263bc633",
]
GOLDEN_LORA_AND_SALT_MATH = [
    "b495e8bfa46c6fe88de1b816842c1519f5c9d12058ebf84a0d1f397c69d8f290",
    "4b5320f4fc5d3c2d1ea772b1ebefe96ac776783d7800d05acc0f95d8c3270053",
]


def test_canonical_forms():
    assert check_namespace(None) is None
    assert check_namespace("a") == "a"
    assert check_namespace(Isolation()) is None
    assert check_namespace(Isolation(salt="a")) == "a"  # no adapter: the plain salt
    ns = Isolation("a", ("math", "/adapters/math"))
    assert check_namespace(ns) is ns and ns.lora == MATH
    assert Isolation("a", MATH) == ns and hash(Isolation("a", MATH)) == hash(ns)


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (3, TypeError, "namespace must be a str, an Isolation or None"),
        (b"a", TypeError, "namespace must be a str"),
        ("\ud800", ValueError, "namespace must be valid Unicode"),
    ],
)
def test_bad_namespaces(bad, error, match):
    with pytest.raises(error, match=match):
        check_namespace(bad)


def test_bad_isolation_fields():
    with pytest.raises(TypeError, match="namespace salt must be a str"):
        Isolation(3)
    with pytest.raises(TypeError, match="lora must be a LoRA"):
        Isolation("a", "math")
    with pytest.raises(ValueError, match=r"\(name, path\) pair"):
        Isolation("a", ("math",))
    with pytest.raises(TypeError, match="lora.path must be a str"):
        LoRA("math", None)
    with pytest.raises(ValueError, match="lora.name must be valid Unicode"):
        LoRA("\udfff", "/p")


def test_extra_keys_are_tagged_in_vllm_order():
    assert extra_keys(None) is None and extra_keys(None, first_block=False) is None
    assert extra_keys("a") == (("cache_salt", "a"),)
    assert extra_keys("a", first_block=False) is None
    ns = Isolation("a", MATH)
    assert extra_keys(ns) == (("lora", "math", "/adapters/math"), ("cache_salt", "a"))
    assert extra_keys(ns, first_block=False) == (("lora", "math", "/adapters/math"),)
    assert extra_keys(Isolation(None, MATH)) == (("lora", "math", "/adapters/math"),)


# Valid text only: a lone surrogate is rejected up front (tested separately).
_text = st.text(st.characters(exclude_categories=("Cs",)))

namespaces = st.one_of(
    st.none(),
    _text,
    _text.map(lambda s: "\0" + s),
    st.builds(Isolation, st.one_of(st.none(), _text), st.builds(LoRA, _text, _text)),
)


@given(namespaces, namespaces)
def test_exact_keys_are_injective(a, b):
    a, b = check_namespace(a), check_namespace(b)
    assert (exact_key(a) == exact_key(b)) == (a == b)
    assert (exact_bytes(a) == exact_bytes(b)) == (a == b)


def test_golden_lora_digests_equal_vllm():
    tokens = list(range(32))
    assert [h.hex() for h in block_hashes(tokens, 16, namespace=Isolation(None, MATH))] == GOLDEN_LORA
    got = block_hashes(tokens, 16, namespace=Isolation("math", MATH))
    assert [h.hex() for h in got] == GOLDEN_LORA_AND_SALT_MATH
    # Plain salts are unchanged (test_hashing.py holds vLLM's salted golden value too).
    assert block_hashes(tokens, 16, namespace="math") != got


@pytest.mark.parametrize("algorithm", ["sha256_cbor", "sha256", "xxhash", "xxhash_cbor"])
def test_native_chain_with_an_adapter_equals_the_reference(algorithm):
    root = none_hash(algorithm, "s")
    ns = Isolation("tenant", LoRA("math", "/adapters/math"))
    first, later = extra_keys(ns), extra_keys(ns, first_block=False)
    tokens = list(range(100, 164))
    assert chain_hashes(tokens, 16, algorithm, root, first, later) == reference_chain_hashes(
        tokens, 16, algorithm, root, first, later
    )
    # A continued chain carries the adapter on every block, and equals the whole chain's tail.
    whole = block_hashes(tokens, 16, algorithm, namespace=ns, seed="s")
    assert block_hashes(tokens[16:], 16, algorithm, namespace=ns, parent=whole[0]) == whole[1:]


SOURCES = {
    "salt 'math'": "math",
    "adapter math": Isolation(None, MATH),
    "salt 'math' + adapter math": Isolation("math", MATH),
    "adapter math, other path": Isolation(None, LoRA("math", "/adapters/math-v2")),
    "adapter named like the salt's tree key": Isolation(None, LoRA("\0l", "")),
    "salt spelling the adapter's tree key": exact_key(Isolation(None, MATH)),
    "no namespace": None,
}


@pytest.mark.parametrize("backend", ["hash", "radix"])
@pytest.mark.parametrize("algorithm", ["sha256_cbor", "xxhash"])
def test_a_salt_equal_to_an_adapter_name_shares_nothing(backend, algorithm):
    cache = prefixcache.build_cache(
        CacheConfig(backend=backend, block_size=4, num_blocks=128, hash=HashConfig(algorithm=algorithm))
    )
    prompt = list(range(1, 22))
    for i, ns in enumerate(SOURCES.values()):
        adm = cache.admit(i, prompt, namespace=ns)
        assert adm.num_cached_tokens == 0, f"{list(SOURCES)[i]} hit another source's blocks"
        cache.commit(i, len(prompt))
        cache.release(i)
    for i, (name, ns) in enumerate(SOURCES.items()):
        assert cache.match(prompt, namespace=ns).num_tokens == 20, f"{name} lost its own blocks"
        adm = cache.admit(("again", i), prompt, namespace=ns)
        assert adm.num_cached_tokens == 20
        cache.release(("again", i))
    assert cache.stats().verify_failures == 0
    cache.check_invariants()


@pytest.mark.parametrize("backend", ["hash", "radix"])
def test_events_carry_the_adapter(backend):
    cache = prefixcache.build_cache(CacheConfig(backend=backend, block_size=16, num_blocks=16))
    ns = Isolation("math", MATH)
    cache.admit("r", list(range(33)), namespace=ns)
    cache.commit("r", 33)
    cache.release("r")
    stored = [e for e in cache.drain_events() if isinstance(e, BlockStored)]
    hashes = [h for e in stored for h in e.block_hashes]
    assert [h.hex() for h in hashes] == GOLDEN_LORA_AND_SALT_MATH
    assert {e.lora_name for e in stored} == {"math"}
    # vLLM's published form: untagged, the adapter's name on every block, the salt on the first.
    assert [k for e in stored for k in e.extra_keys] == [("math", "math"), ("math",)]


@pytest.mark.parametrize("backend", ["hash", "radix"])
@pytest.mark.parametrize("algorithm", ["sha256_cbor", "xxhash"])
def test_a_namespace_utf8_cannot_encode_is_a_clear_error(backend, algorithm):
    """Regression: a lone surrogate reached UTF-8 encoders (cbor2 under sha256_cbor, the
    tree binding under radix) and surfaced as UnicodeEncodeError / RuntimeError."""
    cache = prefixcache.build_cache(
        CacheConfig(backend=backend, block_size=2, num_blocks=8, hash=HashConfig(algorithm=algorithm))
    )
    for call in (
        lambda: cache.admit("r", [1, 2, 3], namespace="\ud800"),
        lambda: cache.match([1, 2], namespace="\udfff"),
    ):
        with pytest.raises(ValueError, match="valid Unicode"):
            call()
    assert cache.pool.num_free == 8
    cache.check_invariants()
