"""The A/B runner: arms replayed through the protocol agree request by request with the
bounds' model, and the schema of ab.yaml rejects every bad field precisely."""

from __future__ import annotations

import textwrap

import pytest

from prefixcache.ab import ABResult, replay_arm, run_ab, sweep
from prefixcache.ab_config import ABConfig, MooncakeSpec, WorkloadSpec, load_ab_config, parse_tokens
from prefixcache.config import CacheConfig, ConfigError
from prefixcache.workloads import (
    BlockPlan,
    Request,
    Workload,
    belady,
    infinite_cache,
    multi_turn,
    records_to_workload,
    shared_prefix,
    synthetic_records,
)

HASH16 = CacheConfig(backend="hash", block_size=16)
RADIX16 = CacheConfig(backend="radix", block_size=16)
RADIX1 = CacheConfig(backend="radix", block_size=1)


def ab(workload_spec: WorkloadSpec | None = None, capacity: int = 1 << 20, **arms: CacheConfig) -> ABConfig:
    arms = arms or {"hash/16": HASH16, "radix/16": RADIX16}
    return ABConfig(workload_spec or WorkloadSpec("shared_prefix"), {k.replace("_", "/"): v for k, v in arms.items()},
                    capacity)


def aligned_workloads() -> list[Workload]:
    """Every shared prefix a whole number of 16-token blocks."""
    return [
        shared_prefix(num_groups=4, prompts_per_group=8, system_prompt_len=128, question_len=32, output_len=16),
        multi_turn(num_conversations=6, turns=4, system_prompt_len=64, question_len=16, answer_len=32),
    ]


@pytest.mark.parametrize("workload", aligned_workloads(), ids=lambda w: w.name)
def test_aligned_workload_ample_pool_hash_and_radix_identical_and_at_the_ceiling(workload):
    result = run_ab(ab(hash_16=HASH16, radix_16=RADIX16), workload)
    hash16, radix16 = result.arm("hash/16"), result.arm("radix/16")
    ceiling = result.bound("infinite", 16)
    assert hash16.hits.hit_tokens == radix16.hits.hit_tokens == ceiling.hits.hit_tokens
    assert hash16.evicted_blocks == radix16.evicted_blocks == 0
    assert hash16.hit_ratio == pytest.approx(workload.analytic_hit_ratio(16), abs=1e-12)
    assert hash16.hit_ratio > 0.5  # the workload does share


@pytest.mark.parametrize("workload", aligned_workloads(), ids=lambda w: w.name)
def test_ample_capacity_belady_equals_the_ceiling(workload):
    result = run_ab(ab(radix_1=RADIX1, hash_16=HASH16), workload)
    for b in (1, 16):
        assert result.bound("belady", b).hits == result.bound("infinite", b).hits
        assert result.bound("belady", b).evictions == 0


def test_non_aligned_prefix_radix1_beats_hash16_by_the_lost_tail_blocks():
    # G groups of M prompts share a 100-token system prompt; 100 = 6*16 + 4. Every prompt
    # after its group's first hits the whole prompt at B = 1 and 96 tokens at B = 16, so
    # radix/1 is ahead by G*(M-1)*4 tokens, of G*M*(100+30) prompt tokens.
    g, m, s, q = 4, 8, 100, 30
    w = shared_prefix(num_groups=g, prompts_per_group=m, system_prompt_len=s, question_len=q, output_len=10)
    result = run_ab(ab(hash_16=HASH16, radix_1=RADIX1), w)
    radix1, hash16 = result.arm("radix/1"), result.arm("hash/16")
    assert radix1.prefill_tokens_saved == g * (m - 1) * s
    assert hash16.prefill_tokens_saved == g * (m - 1) * (s // 16 * 16)
    assert radix1.prefill_tokens_saved - hash16.prefill_tokens_saved == g * (m - 1) * 4
    assert radix1.hit_ratio - hash16.hit_ratio == pytest.approx(g * (m - 1) * 4 / (g * m * (s + q)), abs=1e-12)
    assert radix1.hit_ratio == pytest.approx(w.analytic_hit_ratio(1), abs=1e-12)
    assert hash16.hit_ratio == pytest.approx(w.analytic_hit_ratio(16), abs=1e-12)


def check_under_bounds(result: ABResult, *, belady_bounds_run: bool) -> None:
    for arm in result.arms:
        ceiling = result.bound("infinite", arm.block_size)
        for i, (hit, top) in enumerate(zip(arm.hits.hit_tokens, ceiling.hits.hit_tokens, strict=True)):
            assert hit <= top, f"{arm.name} request {i}: {hit} hit tokens > ceiling {top}"
        if belady_bounds_run:
            assert arm.hit_ratio <= result.bound("belady", arm.block_size).hit_ratio, arm.name


@pytest.mark.parametrize("capacity", [1024, 2048, 4096])
def test_under_eviction_every_arm_is_below_belady_and_each_request_below_the_ceiling(capacity):
    w = multi_turn(num_conversations=12, turns=5, system_prompt_len=100, question_len=30, answer_len=50, seed=3)
    result = run_ab(ab(capacity=capacity, hash_16=HASH16, radix_16=RADIX16, radix_1=RADIX1), w)
    check_under_bounds(result, belady_bounds_run=True)
    assert all(a.evicted_blocks > 0 for a in result.arms)
    assert all(a.hit_ratio > 0 for a in result.arms)


def test_mooncake_format_trace_under_eviction():
    records = synthetic_records(300, seed=5, block_size=64, max_output=100)
    w = records_to_workload(records, block_size=64)
    h64, r64 = CacheConfig(backend="hash", block_size=64), CacheConfig(backend="radix", block_size=64)
    result = run_ab(ab(capacity=64 * 160, hash_64=h64, radix_64=r64), w)
    check_under_bounds(result, belady_bounds_run=True)
    # The same LRU idea at the same block size: they differ only through eviction order.
    assert abs(result.arm("hash/64").hit_ratio - result.arm("radix/64").hit_ratio) < 0.05


def test_requests_larger_than_the_pool_are_rejected_with_zero_hits_like_belady():
    w = shared_prefix(num_groups=2, prompts_per_group=4, system_prompt_len=64, question_len=16, output_len=16)
    big = Request(0.0, range(10**6, 10**6 + 500), range(2 * 10**6, 2 * 10**6 + 10), tag="big")
    w = Workload("with-big", (*w.requests[:3], big, *w.requests[3:]))
    result = run_ab(ab(capacity=256, hash_16=HASH16, radix_1=RADIX1), w)  # 16 blocks: 'big' needs 32
    for arm in result.arms:
        assert arm.rejected == (3,) and arm.hits.hit_tokens[3] == 0
        assert arm.rejected == result.bound("belady", arm.block_size).rejected
    check_under_bounds(result, belady_bounds_run=True)


def test_concurrent_requests_hit_blocks_of_live_ones_and_wait_when_the_pool_is_full():
    # Two requests share a 64-token prefix. With two live, the second hits the first's
    # committed blocks while the first still runs.
    shared = range(0, 64)
    first = Request(0.0, [*shared, *range(1000, 1016)], range(5000, 5016))
    second = Request(0.0, [*shared, *range(2000, 2016)], range(6000, 6016))
    w = Workload("pair", (first, second))
    for arm in run_ab(ab(capacity=4096, hash_16=HASH16, radix_16=RADIX16), w).arms:
        assert arm.hits.hit_tokens == (0, 64) and arm.peak_pinned_blocks == 6  # one at a time
    pair = ABConfig(WorkloadSpec("shared_prefix"), {"hash/16": HASH16, "radix/16": RADIX16}, 4096, max_concurrent=2)
    for arm in run_ab(pair, w).arms:
        assert arm.hits.hit_tokens == (0, 64) and arm.waits == 0
        assert arm.peak_pinned_blocks == 8  # 6 blocks each, the 4 of the shared prefix held by both

    # A pool of 10 blocks holds one 6-block request but not two: the runner releases the
    # oldest live request and retries, and hits stay under the ceiling.
    tight = ABConfig(WorkloadSpec("shared_prefix"), {"hash/16": HASH16, "radix/16": RADIX16}, 160, max_concurrent=3)
    w = multi_turn(num_conversations=4, turns=3, system_prompt_len=32, question_len=16, answer_len=16, seed=1)
    result = run_ab(tight, w)
    check_under_bounds(result, belady_bounds_run=False)
    assert all(a.waits > 0 and a.peak_pinned_blocks <= 10 for a in result.arms)


def test_measurements_are_recorded():
    w = aligned_workloads()[0]
    arm = replay_arm(w, "radix/16", RADIX16.replace(num_blocks=64))
    assert len(arm.bookkeeping_us) == len(w) and all(t > 0 for t in arm.bookkeeping_us)
    assert 0 < arm.us_p50 <= arm.us_p99
    assert arm.events["BlockStored"] > 0 and arm.events["BlockRemoved"] > 0 and arm.events_total > 0
    assert arm.evicted_blocks > 0 and arm.evicted_tokens == 16 * arm.evicted_blocks
    assert 0 < arm.peak_pinned_blocks <= 64
    quiet = replay_arm(w, "radix/16", RADIX16.replace(num_blocks=64, enable_events=False))
    assert quiet.events_total == 0 and quiet.hits == arm.hits


def test_bounds_are_computed_per_block_size_present():
    w = aligned_workloads()[1]
    radix4 = CacheConfig(backend="radix", block_size=4)
    result = run_ab(ab(capacity=4096, hash_16=HASH16, radix_1=RADIX1, radix_4=radix4), w)
    assert [(b.bound, b.block_size, b.capacity_blocks) for b in result.bounds] == [
        ("infinite", 1, None), ("belady", 1, 4096), ("infinite", 4, None), ("belady", 4, 1024),
        ("infinite", 16, None), ("belady", 16, 256),
    ]
    assert result.bound("belady", 4).hits == belady(BlockPlan.of(w, 4), 1024).hits
    assert result.bound("infinite", 1).hits == infinite_cache(BlockPlan.of(w, 1)).hits
    assert [a.capacity_blocks for a in result.arms] == [256, 4096, 1024]  # 4096 tokens each


def test_results_round_trip_through_json_and_csv(tmp_path):
    w = aligned_workloads()[0]
    result = run_ab(ab(capacity=1024, hash_16=HASH16, radix_1=RADIX1), w)
    result.write_json(tmp_path / "ab.json")
    assert ABResult.read_json(tmp_path / "ab.json") == result
    result.write_csv(tmp_path / "summary.csv", tmp_path / "requests.csv")
    summary = (tmp_path / "summary.csv").read_text().splitlines()
    assert summary[0].startswith("series,kind,backend,block_size,capacity_blocks,capacity_tokens,hit_ratio,")
    assert [line.split(",")[0] for line in summary[1:]] == [
        "hash/16", "radix/1", "ceiling B=1", "belady B=1", "ceiling B=16", "belady B=16"]
    requests = (tmp_path / "requests.csv").read_text().splitlines()
    assert len(requests) == 1 + len(w)
    header = requests[0].split(",")
    assert header[:4] == ["request", "prompt_tokens", "hit:hash/16", "hit:radix/1"] and "us:radix/1" in header
    row = dict(zip(header, requests[5].split(","), strict=True))
    assert int(row["hit:hash/16"]) == result.arm("hash/16").hits.hit_tokens[4]


def test_sweep_reports_every_series_at_every_capacity(tmp_path):
    w = aligned_workloads()[1]
    result = sweep(ab(hash_16=HASH16, radix_16=RADIX16), [512, 2048, 65536], w)
    series = result.series()
    assert list(series) == ["hash/16", "radix/16", "ceiling B=16", "belady B=16"]
    assert all([p.capacity_tokens for p in points] == [512, 2048, 65536] for points in series.values())
    assert [p.hit_ratio for p in series["belady B=16"]] == sorted(p.hit_ratio for p in series["belady B=16"])
    assert series["hash/16"][-1].hit_ratio == series["ceiling B=16"][-1].hit_ratio
    result.write_csv(tmp_path / "sweep.csv")
    assert len((tmp_path / "sweep.csv").read_text().splitlines()) == 1 + 4 * 3
    with pytest.raises(ValueError, match="capacity 8 must be an int of TOKENS >= the largest block size 16"):
        sweep(ab(hash_16=HASH16), [8], w)


# --------------------------------------------------------------------------- ab.yaml schema


def write(tmp_path, text: str):
    path = tmp_path / "ab.yaml"
    path.write_text(textwrap.dedent(text))
    return path


GOOD = """
workload: {generator: shared_prefix, params: {num_groups: 2, seed: 1}}
capacity_tokens: 4000
arms:
  hash/16: {backend: hash, block_size: 16}
  radix/1: {backend: radix, block_size: 1, eviction: lfu}
"""


def test_good_file_gives_equal_token_capacity(tmp_path):
    config = load_ab_config(write(tmp_path, GOOD))
    assert config.capacity_tokens == 4000 and config.max_concurrent == 1
    assert {n: (c.backend, c.block_size, c.num_blocks) for n, c in config.arms.items()} == {
        "hash/16": ("hash", 16, 250), "radix/1": ("radix", 1, 4000)}
    assert config.arms["radix/1"].eviction == "lfu" and config.block_sizes == (1, 16)
    assert config.workload.build().params["num_groups"] == 2
    assert config.with_capacity(160).arms["hash/16"].num_blocks == 10
    assert config.sweep_capacities_or_default() == (250, 500, 1000, 2000, 4000, 8000, 16000)
    traced = config.with_trace("t.jsonl")
    assert traced.workload == WorkloadSpec(mooncake=MooncakeSpec(path="t.jsonl")) and traced.arms == config.arms


BAD = [
    ("capacity_tokens: 0", "capacity_tokens: must be an integer >= 1, got 0"),
    ("capacity_tokens: lots", "capacity_tokens: must be an integer, got str 'lots'"),
    ("max_concurrent: 0", "max_concurrent: must be an integer >= 1, got 0"),
    ("sweep_capacities: [100, -1]", "sweep_capacities[1]: must be an integer >= 1 (TOKENS), got -1"),
    ("colour: blue", "colour: unknown key; allowed keys: workload, arms, capacity_tokens, max_concurrent, "
     "sweep_capacities"),
    ("arms: {}", "arms: needs at least one arm"),
    ("arms: {hash/16: {backend: hash, num_blocks: 8}}", "arms.hash/16.num_blocks: set the pool size once with "
     "capacity_tokens"),
    ("arms: {a: {backend: lsm}}", "arms.a.backend: unknown backend 'lsm'; known: hash, radix"),
    ("arms: {a: {block_size: 0}}", "arms.a.block_size: must be an integer >= 1, got 0"),
    ("arms: {a: {block_size: 8192}}", "arms.a.block_size: 8192 TOKENS is more than capacity_tokens=4000"),
    ("arms: {a: {eviction: random}}", "arms.a.eviction: unknown eviction policy 'random'"),
    ("arms: {a: {hash: {algorithm: md5}}}", "arms.a.hash.algorithm: 'md5' is not allowed; allowed values: "
     "sha256_cbor, sha256, xxhash, xxhash_cbor"),
    ("arms: {'my arm': {}}", "arms.my arm: an arm name is letters, digits and _ . : / + -"),
    ("arms: [hash, radix]", "arms: must be a mapping, got list"),
    ("workload: {generator: chat}", "workload.generator: unknown generator 'chat'; allowed values: shared_prefix, "
     "few_shot, multi_turn"),
    ("workload: {generator: multi_turn, params: {turnz: 3}}", "workload.params.turnz: unknown parameter of "
     "generator 'multi_turn'; allowed keys: num_conversations, turns"),
    ("workload: {params: {seed: 1}}", "workload: give exactly one of 'generator'"),
    ("workload: {generator: rag, mooncake: {path: t.jsonl}}", "workload: give exactly one of 'generator'"),
    ("workload: {mooncake: {path: t.jsonl}, params: {a: 1}}", "workload.params: parameters are for a generator"),
    ("workload: {mooncake: {limit: 0}}", "workload.mooncake.limit: must be an integer >= 1 or null, got 0"),
    ("workload: {mooncake: {outputs: maybe}}", "workload.mooncake.outputs: must be true or false, got 'maybe'"),
    ("workload: {mooncake: {file: t.jsonl}}", "workload.mooncake.file: unknown key; allowed keys: path, limit, "
     "outputs, block_size"),
]


@pytest.mark.parametrize("change, expected", BAD, ids=[b[1][:40] for b in BAD])
def test_each_bad_field_is_named_with_what_is_allowed(tmp_path, change, expected):
    key = change.split(":", 1)[0]
    lines = [line for line in textwrap.dedent(GOOD).splitlines() if line and not line.startswith(key)]
    if key == "arms":  # drop the arms block's own lines too
        lines = [line for line in lines if not line.startswith("  ")]
    path = write(tmp_path, "\n".join(lines + [change]) + "\n")
    with pytest.raises(ConfigError) as info:
        load_ab_config(path)
    assert str(info.value).startswith(f"{path}: "), str(info.value)
    assert expected in str(info.value)


def test_missing_required_keys_and_run_time_workload_errors(tmp_path):
    with pytest.raises(ConfigError, match="missing required key\\(s\\): workload, arms, capacity_tokens"):
        load_ab_config(write(tmp_path, "max_concurrent: 2\n"))
    bad_value = load_ab_config(write(tmp_path, GOOD.replace("num_groups: 2", "num_groups: 0")))
    with pytest.raises(ConfigError, match="workload.params: num_groups must be an int >= 1, got 0"):
        bad_value.workload.build()
    no_trace = WorkloadSpec(mooncake=MooncakeSpec())
    with pytest.raises(ConfigError, match="workload.mooncake.path: no trace given: set it, or pass --trace PATH"):
        no_trace.build()
    with pytest.raises(ConfigError, match="workload.mooncake.path: cannot read trace"):
        WorkloadSpec(mooncake=MooncakeSpec(path=str(tmp_path / "absent.jsonl"))).build()
    (tmp_path / "bad.jsonl").write_text('{"timestamp": 0}\n')
    with pytest.raises(ConfigError, match="bad.jsonl:1: missing field\\(s\\) input_length"):
        WorkloadSpec(mooncake=MooncakeSpec(path=str(tmp_path / "bad.jsonl"))).build()


def test_parse_tokens():
    assert parse_tokens("3e6") == 3_000_000 and parse_tokens("4096") == 4096
    for bad in ("0", "1.5", "lots", "inf"):
        with pytest.raises(ValueError, match="TOKENS"):
            parse_tokens(bad)


def test_hybrid_arms_report_their_layout_ceiling_and_the_tokens_it_cannot_cache(tmp_path):
    """A hybrid arm carries its layout's ceiling (the same rules, a pool that never
    evicts): at most what the full-attention ceiling hits, request by request; the
    difference is "uncacheable by layout"; a finer state granule leaves less."""
    from prefixcache.layout import LayerGroup

    w = multi_turn(num_conversations=6, turns=4, system_prompt_len=70, question_len=20, answer_len=30)
    layout = (LayerGroup("full_attention", bytes_per_token=4096), LayerGroup("mamba", state_bytes=65536))
    mamba = CacheConfig(backend="hash", block_size=64, layout=layout)
    fine = mamba.replace(options={"state_granule": 16})
    result = run_ab(ab(capacity=1024, hash_64=CacheConfig(backend="hash", block_size=64), mamba=mamba, fine=fine), w)
    full = result.bound("infinite", 64)
    assert result.arm("hash/64").layout_ceiling is None
    for name in ("mamba", "fine"):
        arm = result.arm(name)
        assert all(h <= c for h, c in zip(arm.hits.hit_tokens, arm.layout_ceiling.hit_tokens))
    mamba_arm = result.arm("mamba")
    assert all(c <= f for c, f in zip(mamba_arm.layout_ceiling.hit_tokens, full.hits.hit_tokens))
    lost = mamba_arm.uncacheable_by_layout(full.hits)
    assert lost == full.hits.total_hit_tokens - mamba_arm.layout_ceiling.total_hit_tokens > 0
    assert result.arm("fine").uncacheable_by_layout(full.hits) < lost
    rows = {r["series"]: r for r in result.summary_rows()}
    assert rows["mamba"]["uncacheable_by_layout"] == lost and rows["hash/64"]["uncacheable_by_layout"] is None
    assert rows["fine"]["bytes_per_token"] == "full_attention: 4,096 | mamba: 1,024"
    result.write_json(tmp_path / "ab.json")
    assert ABResult.read_json(tmp_path / "ab.json") == result


def test_a_radix_layout_ceiling_evicts_from_none_of_its_pools():
    """radix splits the pool (FULL, SWA by pool_ratio, Mamba state slots): its layout's
    ceiling raises each, so a tight state pool or SWA share changes the arm's hits, not
    its ceiling, which is then what the layout's rules hit with room everywhere."""
    from prefixcache.layout import LayerGroup

    w = multi_turn(num_conversations=8, turns=4, system_prompt_len=70, question_len=20, answer_len=30)

    def layout(slots: int, ratio: float) -> tuple:
        return (LayerGroup("full_attention"), LayerGroup("sliding_window", window=32, pool_ratio=ratio),
                LayerGroup("mamba", slots=slots))  # fmt: skip

    opts = {"mamba_chunk": 16, "mamba_track_interval": 32}
    arms = {f"s{slots}r{ratio}": CacheConfig(backend="radix", block_size=16, layout=layout(slots, ratio), options=opts)
            for slots, ratio in ((6, 0.2), (6, 1.0), (200, 1.0))}  # fmt: skip
    result = run_ab(ab(capacity=8192, **arms), w)
    ceilings = {name: result.arm(name).layout_ceiling.hit_tokens for name in arms}
    assert len({tuple(c) for c in ceilings.values()}) == 1, ceilings
    assert result.arm("s6r0.2").hits.total_hit_tokens < result.arm("s200r1.0").hits.total_hit_tokens


def test_hybrid_arms_carry_belady_over_the_layouts_units(tmp_path):
    """Beside a hybrid arm, Belady over its layout's units at the arm's pool: the bound's
    own result on the workload's plan, reported as a column, kept in the JSON, and here
    above what the arm's LRU and sparse retention hit; none for a full-attention arm."""
    from prefixcache.layout import LayerGroup, Layout
    from prefixcache.workloads import BlockPlan, layout_belady

    w = multi_turn(num_conversations=6, turns=4, system_prompt_len=70, question_len=20, answer_len=30)
    layout = (LayerGroup("full_attention"), LayerGroup("sliding_window", window=48), LayerGroup("mamba"))
    hybrid = CacheConfig(backend="hash", block_size=16, layout=layout)
    result = run_ab(ab(capacity=1024, hash_16=CacheConfig(backend="hash", block_size=16), hybrid=hybrid), w)
    arm = result.arm("hybrid")
    expected = layout_belady(BlockPlan.of(w, 16), Layout(layout), 64)
    assert arm.layout_belady == expected.hits
    assert arm.layout_belady.total_hit_tokens > arm.hits.total_hit_tokens
    assert result.arm("hash/16").layout_belady is None
    rows = {r["series"]: r for r in result.summary_rows()}
    assert rows["hybrid"]["layout_belady_hit_ratio"] == expected.hit_ratio
    assert rows["hash/16"]["layout_belady_hit_ratio"] is None
    result.write_json(tmp_path / "ab.json")
    assert ABResult.read_json(tmp_path / "ab.json") == result
