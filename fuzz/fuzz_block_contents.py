"""Fuzz harness: hit verification (native BlockContents) against its Python model.

Each input records chains of blocks (fresh or extending a recorded block, any
namespace, now and then a parent that makes no sense or token ids beyond int32 /
int64), indexes them under a key with only three values (so every look-up meets
impostors), evicts keys, and looks chains up. Both stores must answer alike, and
every block either proves must truly hold the request's namespace and prefix.

    python fuzz/fuzz_block_contents.py -max_total_time=600
"""

from __future__ import annotations

from harness import main
from reader import Reader
from test_block_contents import ContentsMachine


def test_one_input(data: bytes) -> None:
    r = Reader(data)
    m = ContentsMachine()
    n = ContentsMachine.NUM_BLOCKS
    namespaces = [b"", b"\x01a", b"\x01b"]
    while not r.exhausted:
        op = r.int(0, 5)
        ns = r.choice(namespaces)
        if op <= 1:
            blocks = list(dict.fromkeys(r.int(0, n - 1) for _ in range(r.int(1, 3))))
            m.record(r.int(-1, n - 1), blocks, [r.token(2) for _ in range(6)], ns)
        elif op == 2:
            m.uncache(r.int(0, n - 1))
        elif op <= 4:
            m.lookup(r.int(-1, n - 1), [r.token(2) for _ in range(r.int(0, 4))], r.int(-1, 7), ns)
        else:
            m.verify([r.int(0, n - 1) for _ in range(r.int(1, 4))], [r.token(2) for _ in range(8)], ns)
        m.same_descriptors()


if __name__ == "__main__":
    main(test_one_input)
