"""One cache for facts computed from tensors: a value keyed by the identities of some tensors
(plus a plain key), valid while every one of them lives and none was modified in place (their
version counters). The native paths use it to skip host synchronisations and rebuilds for
tensors they have already checked or built from (sparse rule books, BEV ranks, RoIAware's
saved argmax)."""

from __future__ import annotations

import collections
import weakref


class TensorKeyedCache:
    """`store(tensors, key, value, also=())` / `lookup(tensors, key)`: an entry answers only for
    the same tensor objects and key, while those tensors and `also` (tensors the value was
    built with: their in-place change makes it stale too) keep their version counters. An entry
    is dropped when any of `tensors` is freed; inference tensors (no version counter) are never
    stored. At most MAX_ENTRIES, the least recently used dropped first."""

    MAX_ENTRIES = 64

    def __init__(self):
        self._entries: collections.OrderedDict = collections.OrderedDict()

    @staticmethod
    def _versions(tensors):
        if any(t.is_inference() for t in tensors):
            return None
        return tuple(t._version for t in tensors)

    def store(self, tensors, key, value, also=()) -> None:
        versions = self._versions((*tensors, *also))
        if versions is None:
            return
        full = (tuple(id(t) for t in tensors), key)
        cache = weakref.ref(self)

        def forget(dead, full=full):  # the entry goes with any of its tensors
            entries = getattr(cache(), "_entries", None)
            entry = entries.get(full) if entries is not None else None
            if entry is not None and any(ref is dead for ref in entry[0]):
                del entries[full]

        refs = tuple(weakref.ref(t, forget) for t in tensors)
        self._entries[full] = (refs, versions, tuple(also), value)
        self._entries.move_to_end(full)
        while len(self._entries) > self.MAX_ENTRIES:
            self._entries.popitem(last=False)

    def lookup(self, tensors, key):
        full = (tuple(id(t) for t in tensors), key)
        entry = self._entries.get(full)
        if entry is None:
            return None
        refs, versions, also, value = entry
        if any(ref() is not t for ref, t in zip(refs, tensors)) or versions != self._versions(
            (*tensors, *also)
        ):
            del self._entries[full]
            return None
        self._entries.move_to_end(full)
        return value

    def clear(self) -> None:
        self._entries.clear()


class SavedForBackward(TensorKeyedCache):
    """What a forward computed for its backward (e.g. the max winners), by the forward's input
    tensors alone: `put(inputs, value)` / `get(inputs)`. Autograd keeps the inputs alive until the
    backward has run, so an entry lives that long; at most MAX_ENTRIES; a miss only means the
    backward's slower path."""

    MAX_ENTRIES = 8

    def put(self, tensors, value) -> None:
        self.store(tuple(tensors), None, value)

    def get(self, tensors):
        return self.lookup(tuple(tensors), None)
