"""A dict that keeps only its most recently set keys."""

from __future__ import annotations

from collections import OrderedDict
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


class BoundedDict(OrderedDict[K, V]):
    """Insertion-ordered, holding at most ``maxlen`` keys: setting a key makes it the
    newest, and beyond ``maxlen`` the oldest go. (``move_to_end`` on a read makes it a
    least-recently-used cache.)"""

    def __init__(self, maxlen: int) -> None:
        super().__init__()
        self.maxlen = maxlen

    def __setitem__(self, key: K, value: V) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.maxlen:
            self.popitem(last=False)
