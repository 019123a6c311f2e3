"""`_C.int32_arrays`: tables of ids as int32 arrays of a given array type, in one call."""

from __future__ import annotations

from array import array

import pytest

from prefixcache._C import int32_arrays
from prefixcache.protocol import BlockIds


def test_each_table_comes_back_as_the_type_asked_with_its_ids():
    out = int32_arrays(BlockIds, [[3, 4, 5], [], [-1, 2**31 - 1]])
    assert [type(t) for t in out] == [BlockIds] * 3
    assert [t.tolist() for t in out] == [[3, 4, 5], [], [-1, 2**31 - 1]]
    assert out[0] == (3, 4, 5) and out[0].typecode == "i"
    assert type(int32_arrays(array, [[1]])[0]) is array


def test_a_bad_type_or_id_is_refused_by_name():
    with pytest.raises(TypeError, match="cls"):
        int32_arrays(list, [[1]])
    with pytest.raises(ValueError, match="ids"):
        int32_arrays(BlockIds, [[2**31]])
    with pytest.raises(TypeError, match="ids"):
        int32_arrays(BlockIds, [[1.0]])
