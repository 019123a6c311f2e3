"""The built-in strategies, installed as `prefixcache.backends`.

`hash` (vLLM V1 automatic prefix caching) and `radix` (SGLang RadixAttention). Each
module holds one `PrefixCache` subclass and nothing more; the shared pieces (pool,
hashing, stats, events) come from the core. The registry imports these lazily by
dotted path, so the core never imports this package.
"""
