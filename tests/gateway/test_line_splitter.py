"""NDJSON streams (Ollama's) cut into whole lines however the bytes arrive."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.proxy.sse import LineSplitter

pytestmark = pytest.mark.mode_independent


@settings(max_examples=200, deadline=None)
@given(
    lines=st.lists(
        st.binary(max_size=20).map(lambda b: b.replace(b"\n", b"")), max_size=6
    ),
    tail=st.binary(max_size=10).map(lambda b: b.replace(b"\n", b"")),
    cuts=st.lists(st.integers(min_value=0), max_size=8),
)
def test_lines_come_out_whole_and_the_unfinished_one_is_kept(lines, tail, cuts):
    raw = b"".join(line + b"\n" for line in lines) + tail
    splitter = LineSplitter()
    points = sorted({c % (len(raw) + 1) for c in cuts} | {0, len(raw)})
    out: list[bytes] = []
    for a, b in itertools.pairwise(points):
        out += splitter.feed(raw[a:b])
    assert out == [line + b"\n" for line in lines]
    assert splitter.pending_size == len(tail)
    assert splitter.rest() == tail
