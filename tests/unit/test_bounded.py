"""``BoundedDict``: the newest ``maxlen`` keys, setting a key making it the newest."""

from __future__ import annotations

from lamina.libs.bounded import BoundedDict


def test_the_oldest_set_key_goes_first():
    seen: BoundedDict[str, int] = BoundedDict(2)
    seen["a"], seen["b"] = 1, 2
    seen["a"] = 3  # set again: now the newest
    seen["c"] = 4
    assert list(seen.items()) == [("a", 3), ("c", 4)]
    seen.move_to_end("a")  # read as a cache reads it: kept over "c"
    seen["d"] = 5
    assert list(seen) == ["a", "d"]
