"""Readable Python twins of native pieces, used by the tests that compare them side by side."""
