"""Workloads: token runs, generators (measured ceiling == analytic value), determinism,
Mooncake traces (small generated ones, never the real files), save/load."""

from __future__ import annotations

import inspect
import json
import math
import random
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.protocol import as_tokens
from prefixcache.workloads import (
    GENERATORS,
    BlockPlan,
    MooncakeRecord,
    Request,
    TokenRuns,
    TokenSource,
    Workload,
    generate,
    infinite_cache,
    load_workload,
    multi_turn,
    rag,
    read_mooncake,
    read_records,
    records_to_workload,
    save_workload,
    shared_prefix,
    synthetic_records,
    tree_of_thought,
    workload_to_records,
    write_records,
)
from prefixcache.workloads.mooncake import published_ceiling

# ---------------------------------------------------------------- token runs


def test_token_runs_merge_consecutive_runs_and_index():
    t = TokenRuns([(0, 3), (3, 5), (5, 5), (10, 12)])
    assert t.runs == ((0, 5), (10, 12))
    assert len(t) == 7 and t.tolist() == [0, 1, 2, 3, 4, 10, 11]
    assert t[5] == 10 and t[-1] == 11 and t[4] == 4
    assert t[3:6].runs == ((3, 5), (10, 11))
    assert list(t[::2]) == [0, 2, 4, 11]
    assert as_tokens(t) == t.tolist()  # what a backend's admit() receives
    assert TokenRuns.of([0, 1, 2, 3, 4, 10, 11]) == t and t == list(t)
    with pytest.raises(IndexError):
        t[7]


def test_token_runs_reject_bad_runs_and_tokens():
    with pytest.raises(ValueError, match="token run"):
        TokenRuns([(5, 3)])
    with pytest.raises(ValueError, match="non-negative"):
        TokenRuns.of([1, -2])
    with pytest.raises(TypeError):
        TokenRuns.of("abc")


def test_token_source_never_repeats_an_id():
    src = TokenSource(start=100)
    a, b, c = src.fresh(5), src.fresh(0), src.fresh(3)
    assert a.tolist() == [100, 101, 102, 103, 104] and len(b) == 0 and c.tolist() == [105, 106, 107]
    assert src.next_id == 108
    with pytest.raises(ValueError, match="num_tokens"):
        src.fresh(-1)


def test_full_blocks_name_blocks_by_content():
    t = TokenRuns([(0, 6), (20, 23)])  # 0 1 2 3 4 5 20 21 22
    assert list(t.full_blocks(4)) == [0, ((4, 6), (20, 22))]  # the 1-token tail is not a full block
    assert list(t.full_blocks(1)) == t.tolist()
    with pytest.raises(ValueError, match="block_size"):
        list(t.full_blocks(0))


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 12), min_size=0, max_size=14), min_size=2, max_size=2),
    st.integers(1, 5),
)
def test_full_blocks_equal_names_iff_equal_tokens(seqs, block_size):
    """Naming a block by its runs is exact: two blocks get one name iff they hold the same tokens."""
    named = [list(TokenRuns.of(s).full_blocks(block_size)) for s in seqs]
    raw = [[tuple(s[i : i + block_size]) for i in range(0, len(s) - block_size + 1, block_size)] for s in seqs]
    assert [len(n) for n in named] == [len(r) for r in raw]
    for i, name_a in enumerate(named[0]):
        for j, name_b in enumerate(named[1]):
            assert (name_a == name_b) == (raw[0][i] == raw[1][j])


# ---------------------------------------------------------------- generators: analytic == measured

# Small instances with lengths that are NOT multiples of the block sizes tested, and a
# few that are, so whole-block rounding and the len-1 cap are both exercised.
SMALL = {
    "shared_prefix": [dict(num_groups=5, prompts_per_group=7, system_prompt_len=45, question_len=9, output_len=5),
                      dict(num_groups=3, prompts_per_group=4, system_prompt_len=64, question_len=1, output_len=0)],
    "few_shot": [dict(num_tasks=3, queries_per_task=9, instruction_len=13, examples_len=50, query_len=6, label_len=1),
                 dict(num_tasks=2, queries_per_task=5, instruction_len=0, examples_len=32, query_len=3, label_len=2)],
    "multi_turn": [dict(num_conversations=6, turns=5, system_prompt_len=21, question_len=7, answer_len=11),
                   dict(num_conversations=4, turns=3, system_prompt_len=0, question_len=8, answer_len=8)],
    "parallel_sampling": [dict(num_prompts=5, n=4, prompt_len=37, output_len=6),
                          dict(num_prompts=3, n=3, prompt_len=32, output_len=0)],
    "tree_of_thought": [dict(num_problems=3, problem_len=29, branching=3, depth=3, thought_len=11),
                        dict(num_problems=2, problem_len=16, branching=2, depth=4, thought_len=16)],
    "no_sharing": [dict(num_requests=20, prompt_len=33, output_len=3)],
}
EXACT_CASES = [(name, i, params) for name, cases in SMALL.items() for i, params in enumerate(cases)]


@pytest.mark.parametrize("name,case,params", EXACT_CASES, ids=[f"{n}-{i}" for n, i, _ in EXACT_CASES])
@pytest.mark.parametrize("block_size", [1, 4, 7, 16])
def test_measured_ceiling_equals_analytic_exactly(name, case, params, block_size):
    for seed in (0, 1):
        w = generate(name, seed=seed, **params)
        assert w.analytic_exact
        measured = infinite_cache(BlockPlan.of(w, block_size)).hit_ratio
        assert math.isclose(measured, w.analytic_hit_ratio(block_size), rel_tol=1e-12, abs_tol=1e-15), (seed, measured)


def test_every_catalogued_generator_is_tested():
    assert set(SMALL) | {"rag"} == set(GENERATORS)


def test_shared_prefix_defaults_give_sglang_ratio():
    w = shared_prefix(seed=0)
    assert len(w) == 64 * 16 and {r.prompt_len for r in w.requests} == {2048 + 128}
    assert {r.output_len for r in w.requests} == {256}
    expected = 15 / 16 * 2048 / 2176  # 0.88235
    for block_size in (1, 16):
        assert w.analytic_hit_ratio(block_size) == pytest.approx(expected, abs=1e-15)
        assert infinite_cache(BlockPlan.of(w, block_size)).hit_ratio == pytest.approx(expected, abs=1e-15)
    assert round(expected, 3) == 0.882


def test_shared_prefix_non_aligned_system_prompt_loses_its_tail_block():
    w = shared_prefix(num_groups=2, prompts_per_group=3, system_prompt_len=20, question_len=5, output_len=2)
    # B = 1: 2 groups x 2 later prompts x 20 tokens; B = 16: only 16 of the 20 are a whole block.
    assert infinite_cache(BlockPlan.of(w, 1)).hits.total_hit_tokens == 4 * 20
    assert infinite_cache(BlockPlan.of(w, 16)).hits.total_hit_tokens == 4 * 16


def test_rag_measured_ceiling_matches_its_expectation():
    """RAG's formula is an expectation over the document draws. Over 30 seeds the measured
    deviation had sd 0.0029 at these (default) sizes; allow 4 sd per seed and 3.5 sd of
    the mean of 10."""
    deviations = []
    for seed in range(10):
        w = rag(seed=seed)
        assert not w.analytic_exact
        deviations.append(infinite_cache(BlockPlan.of(w, 16)).hit_ratio - w.analytic_hit_ratio(16))
    assert max(abs(d) for d in deviations) < 0.012
    assert abs(statistics.mean(deviations)) < 0.003


def test_rag_without_a_pool_to_share_hits_only_the_instructions():
    w = rag(num_requests=6, instruction_len=10, num_documents=1, docs_per_request=1, document_len=7,
            question_len=3, output_len=1)
    # One document: every later request hits instructions + the document, at B = 1 exactly.
    assert infinite_cache(BlockPlan.of(w, 1)).hits.hit_tokens == (0, 17, 17, 17, 17, 17)
    assert w.analytic_hit_ratio(1) == pytest.approx(5 * 17 / (6 * 20))


def test_multi_turn_prompt_contains_all_earlier_turns_and_answers():
    w = multi_turn(num_conversations=2, turns=3, system_prompt_len=5, question_len=3, answer_len=4, seed=3)
    by_tag = {r.tag: r for r in w.requests}
    for c in range(2):
        for k in (1, 2):
            earlier, later = by_tag[f"conv{c}/turn{k}"], by_tag[f"conv{c}/turn{k + 1}"]
            history = earlier.prompt + earlier.output
            assert later.prompt[: len(history)] == history and len(later.prompt) == len(history) + 3
    order = [r.tag for r in w.requests]
    assert order.index("conv0/turn1") < order.index("conv0/turn2") < order.index("conv0/turn3")
    assert by_tag["conv0/turn1"].prompt[:5] == by_tag["conv1/turn1"].prompt[:5]  # shared system prompt
    assert by_tag["conv0/turn1"].prompt[5:] != by_tag["conv1/turn1"].prompt[5:]


def test_tree_of_thought_children_extend_the_request_that_made_their_node():
    w = tree_of_thought(num_problems=2, problem_len=6, branching=2, depth=3, thought_len=4, seed=1)
    assert len(w) == 2 * (2 + 4 + 8)
    by_tag = {r.tag: r for r in w.requests}
    producer = by_tag["problem1/0/1"]  # made thought 1 under thought 0
    for c in range(2):
        child = by_tag[f"problem1/0/1/{c}"]
        assert child.prompt == producer.prompt + producer.output
    siblings = [by_tag["problem0/1/0"].prompt, by_tag["problem0/1/1"].prompt]
    assert siblings[0] == siblings[1]
    order = [r.tag for r in w.requests]
    assert order.index("problem1/0/1") < order.index("problem1/0/1/0")


def test_unrelated_content_shares_no_token():
    w = shared_prefix(num_groups=3, prompts_per_group=2, system_prompt_len=10, question_len=4, output_len=3)
    systems = {r.tag.split("/")[0]: set(r.prompt[:10]) for r in w.requests}
    assert not systems["group0"] & systems["group1"] and not systems["group1"] & systems["group2"]
    questions = [set(r.prompt[10:]) | set(r.output) for r in w.requests]
    assert sum(len(q) for q in questions) == len(set().union(*questions))


# ---------------------------------------------------------------- determinism and validation


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_same_seed_same_workload(name):
    a, b = generate(name, seed=7, request_rate=5.0), generate(name, seed=7, request_rate=5.0)
    assert a == b and [r.arrival_s for r in a.requests] == [r.arrival_s for r in b.requests]
    c = generate(name, seed=8, request_rate=5.0)
    assert [r.arrival_s for r in a.requests] != [r.arrival_s for r in c.requests]


@pytest.mark.parametrize("name", ["shared_prefix", "few_shot", "multi_turn", "rag", "tree_of_thought"])
def test_seed_changes_the_order(name):
    a, b = generate(name, seed=1), generate(name, seed=2)
    assert [r.tag for r in a.requests] != [r.tag for r in b.requests]


def test_generators_leave_global_random_state_alone():
    random.seed(123)
    before = random.getstate()
    shared_prefix(seed=4, request_rate=2.0)
    rag(seed=4)
    assert random.getstate() == before


def test_poisson_arrivals_are_ordered_and_at_the_requested_rate():
    w = shared_prefix(num_groups=40, prompts_per_group=50, system_prompt_len=4, question_len=2, output_len=1,
                      request_rate=20.0, seed=5)
    times = [r.arrival_s for r in w.requests]
    assert times == sorted(times) and times[0] > 0
    assert times[-1] / len(times) == pytest.approx(1 / 20.0, rel=0.05)  # mean gap; 2000 draws: sd 2.2%
    assert {r.arrival_s for r in shared_prefix(num_groups=2, prompts_per_group=2).requests} == {0.0}


@pytest.mark.parametrize(
    "name,params,message",
    [
        ("shared_prefix", dict(num_groups=0), "num_groups must be an int >= 1"),
        ("shared_prefix", dict(question_len=0), "question_len must be an int >= 1"),
        ("multi_turn", dict(turns=2.5), "turns must be an int >= 1"),
        ("rag", dict(num_documents=2, docs_per_request=3), "docs_per_request=3 must be <= num_documents=2"),
        ("no_sharing", dict(request_rate=0), "request_rate must be a positive number"),
        ("tree_of_thought", dict(depth=True), "depth must be an int >= 1"),
        ("few_shot", dict(seeed=1), "unknown parameter"),
        ("zipf", {}, "unknown workload generator 'zipf'; known: shared_prefix"),
    ],
)
def test_bad_parameters_name_the_field(name, params, message):
    with pytest.raises(ValueError, match=message):
        generate(name, **params)


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_every_generator_names_a_bad_int_parameter_the_same_way(name):
    """Each generator's own parameter name, never a helper's, and the rule it broke."""
    params = [p for p in inspect.signature(GENERATORS[name].make).parameters if p not in ("seed", "request_rate")]
    assert params
    for param in params:
        for bad in (-1, 2.5, True):
            with pytest.raises(ValueError, match=rf"^{param} must be an int >= [01], got {bad!r}$"):
                generate(name, **{param: bad})
    with pytest.raises(ValueError, match="request_rate must be a positive number"):
        GENERATORS[name].make(request_rate=-1.0)


def test_synthetic_trace_parameters_are_checked_by_the_same_rules():
    for params, message in (
        ({"num_records": -1}, "num_records must be an int >= 0, got -1"),
        ({"block_size": 1}, "block_size must be an int >= 2, got 1"),
        ({"reuse_probability": 1.5}, r"reuse_probability must be in \[0, 1\], got 1.5"),
        ({"aligned_probability": "x"}, r"aligned_probability must be in \[0, 1\], got 'x'"),
    ):
        with pytest.raises(ValueError, match=message):
            synthetic_records(**params)


def test_request_and_workload_validation():
    with pytest.raises(ValueError, match="prompt must have at least one token"):
        Request(0.0, [])
    with pytest.raises(ValueError, match="arrival_s"):
        Request(-1.0, [1])
    with pytest.raises(TypeError, match="namespace"):
        Request(0.0, [1], namespace=3)
    with pytest.raises(ValueError, match="arrival order"):
        Workload("w", (Request(2.0, [1]), Request(1.0, [2])))
    with pytest.raises(ValueError, match="block_size"):
        shared_prefix(num_groups=1).analytic_hit_ratio(0)


def test_with_namespace_and_head():
    w = shared_prefix(num_groups=2, prompts_per_group=3, system_prompt_len=8, question_len=2, output_len=1)
    t = w.with_namespace("tenant-a")
    assert {r.namespace for r in t.requests} == {"tenant-a"}
    assert t.analytic_hit_ratio(4) == w.analytic_hit_ratio(4)
    assert len(w.head(2)) == 2 and w.head(2).analytic_hit_ratio(4) is None


# ---------------------------------------------------------------- Mooncake traces


def test_mooncake_trace_expands_ids_into_token_blocks(tmp_path):
    records = [
        MooncakeRecord(0, 1000, 30, (0, 1)),  # 512 + 488; with its output 3 blocks
        MooncakeRecord(1500, 1024, 0, (0, 2)),  # two full blocks
        MooncakeRecord(1500, 700, 3, (0, 1)),  # same ids as line 1, shorter tail
    ]
    path = tmp_path / "t.jsonl"
    write_records(path, records)
    w = read_mooncake(path)
    a, b, c = w.requests
    assert [r.arrival_s for r in w.requests] == [0.0, 1.5, 1.5]
    assert a.prompt.runs == ((0, 1000),)  # blocks 0 and 1 are consecutive ranges
    assert b.prompt.runs == ((0, 512), (1024, 1536))
    assert c.prompt == a.prompt[:700]  # equal ids -> equal tokens
    assert [len(r.output) for r in w.requests] == [30, 0, 3]
    assert min(a.output) == 3 * 512 and set(a.output).isdisjoint(c.output)  # outputs above every block
    hits = infinite_cache(BlockPlan.of(w, 512)).hits.hit_tokens
    assert hits == (0, 512, 512)  # line 3: block 1 (partial) is never cached as a full block
    assert infinite_cache(BlockPlan.of(w, 1)).hits.hit_tokens == (0, 512, 699)  # token level: len-1 cap
    bare = read_mooncake(path, outputs=False)
    assert [len(r.output) for r in bare.requests] == [0, 0, 0] and [r.prompt for r in bare.requests] == [
        r.prompt for r in w.requests
    ]
    assert BlockPlan.of(bare, 512).footprint == (2, 2, 2) and BlockPlan.of(w, 512).footprint == (3, 2, 2)


def _ceiling_from_hash_ids(records, block_size=512):
    """Independent ceiling straight from the ids: a block is hittable when the same id
    prefix was a FULL block earlier, up to floor((len-1)/512) blocks."""
    full_prefixes, hits = set(), []
    for r in records:
        cap = (r.input_length - 1) // block_size
        h = 0
        while h < cap and r.hash_ids[: h + 1] in full_prefixes:
            h += 1
        hits.append(h * block_size)
        for j in range(r.input_length // block_size):
            full_prefixes.add(r.hash_ids[: j + 1])
    return hits


def test_read_generated_trace_and_check_the_ceiling(tmp_path):
    records = synthetic_records(300, seed=11)
    assert any(r.input_length % 512 == 0 for r in records) and any(r.input_length % 512 for r in records)
    path = tmp_path / "synthetic.jsonl"
    write_records(path, records)
    assert read_records(path) == records
    assert read_records(path, limit=10) == records[:10]
    w = read_mooncake(path)
    assert len(w) == 300 and w.prompt_tokens == sum(r.input_length for r in records)
    result = infinite_cache(BlockPlan.of(w, 512))
    assert list(result.hits.hit_tokens) == _ceiling_from_hash_ids(records)
    assert result.hit_ratio > 0.2  # the generator does share prefixes
    whole, last_half = published_ceiling(records)
    assert whole >= result.hit_ratio and last_half >= result.last_half_hit_ratio


def test_published_ceiling_counts_partial_blocks_and_whole_prompts():
    records = [MooncakeRecord(0, 700, 1, (0, 1)), MooncakeRecord(0, 700, 1, (0, 1)), MooncakeRecord(0, 300, 1, (5,))]
    whole, last_half = published_ceiling(records)
    assert whole == pytest.approx(700 / 1700) and last_half == pytest.approx(700 / 1000)
    # A real cache: the second request hits block 0 only (block 1 is partial).
    assert infinite_cache(BlockPlan.of(records_to_workload(records), 512)).hits.hit_tokens == (0, 512, 0)


@pytest.mark.parametrize(
    "line,message",
    [
        ("not json", "not valid JSON"),
        ('{"timestamp": 0, "input_length": 10, "hash_ids": [1]}', "missing field.*output_length"),
        ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}', "needs ceil\\(600/512\\) = 2"),
        ('{"timestamp": -5, "input_length": 1, "output_length": 1, "hash_ids": [1]}', "'timestamp'"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}', "'input_length' must be an int"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [-1]}', "'hash_ids' must hold ints"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1], "block_size": 64}', "block_size"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_malformed_trace_lines_are_named(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n' + line + "\n")
    with pytest.raises(ValueError, match=f"bad.jsonl:2: .*{message}"):
        read_records(path)


def test_workload_exports_to_mooncake_and_back_at_block_512(tmp_path):
    w = shared_prefix(num_groups=3, prompts_per_group=5, system_prompt_len=1100, question_len=300, output_len=50,
                      request_rate=10.0, seed=2)
    records = workload_to_records(w)
    assert [len(r.hash_ids) for r in records] == [math.ceil(1400 / 512)] * 15
    path = tmp_path / "export.jsonl"
    write_records(path, records)
    back = read_mooncake(path)
    assert [r.prompt_len for r in back.requests] == [r.prompt_len for r in w.requests]
    assert [r.arrival_s for r in back.requests] == pytest.approx([r.arrival_s for r in w.requests], abs=1e-3)
    original = infinite_cache(BlockPlan.of(w, 512)).hits
    assert infinite_cache(BlockPlan.of(back, 512)).hits == original and original.total_hit_tokens == 12 * 1024


def test_exported_namespaces_do_not_share_ids():
    w = shared_prefix(num_groups=1, prompts_per_group=2, system_prompt_len=600, question_len=4, output_len=1)
    mixed = Workload("mixed", (w.requests[0], w.with_namespace("b").requests[1]))
    a, b = workload_to_records(mixed)
    assert not set(a.hash_ids) & set(b.hash_ids)


# ---------------------------------------------------------------- save / load


def test_save_load_round_trip_keeps_everything(tmp_path):
    w = multi_turn(num_conversations=3, turns=4, system_prompt_len=17, question_len=5, answer_len=9,
                   seed=9, request_rate=3.0).with_namespace("tenant")
    path = tmp_path / "w.jsonl"
    save_workload(path, w)
    back = load_workload(path)
    assert back == w and back.params == w.params
    assert back.analytic_hit_ratio(4) == w.analytic_hit_ratio(4)
    assert path.stat().st_size < 8000  # runs, not token lists
    header = json.loads(path.read_text().splitlines()[0])
    assert header["generator"] == "multi_turn" and header["params"]["seed"] == 9


def test_load_rejects_a_file_that_is_not_a_workload(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"timestamp": 0}\n')
    with pytest.raises(ValueError, match="x.jsonl:1: not a prefixcache workload header"):
        load_workload(path)
    path.write_text('{"prefixcache_workload": 1, "name": "w"}\n{"arrival_s": 0, "prompt": [[0, 2]]}\n')
    with pytest.raises(ValueError, match="x.jsonl:2: bad request"):
        load_workload(path)
