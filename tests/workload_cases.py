"""Workloads the bound tests share: explicit ones written out request by request, and a
hypothesis strategy for small random ones with lots of sharing."""

from __future__ import annotations

from hypothesis import strategies as st

from prefixcache.workloads import Request, TokenRuns, TokenSource, Workload


def workload(*requests: tuple[list[int], list[int]] | tuple[list[int], list[int], str]) -> Workload:
    """Requests from explicit (prompt, output[, namespace]) token lists."""
    return Workload("hand", tuple(Request(0.0, r[0], r[1], r[2] if len(r) > 2 else None) for r in requests))


@st.composite
def random_workloads(draw) -> Workload:
    """Small workloads with lots of sharing: prompts built from a few shared segments or
    by continuing an earlier request (its prompt + output), some in a second namespace,
    some identical (the len-1 cap), lengths of any alignment."""
    src = TokenSource()
    segments = [src.fresh(draw(st.integers(1, 5))) for _ in range(4)]
    requests: list[Request] = []
    for _ in range(draw(st.integers(1, 14))):
        if requests and draw(st.booleans()):
            earlier = requests[draw(st.integers(0, len(requests) - 1))]
            base = earlier.prompt + earlier.output
        else:
            base = sum((segments[k] for k in draw(st.lists(st.integers(0, 3), max_size=3))), TokenRuns())
        prompt = base + src.fresh(draw(st.integers(0 if len(base) else 1, 3)))
        namespace = draw(st.sampled_from([None, None, None, "b"]))
        requests.append(Request(0.0, prompt, src.fresh(draw(st.integers(0, 3))), namespace))
    return Workload("random", tuple(requests))
