"""A GGUF metadata string array held compactly (the vocabulary and merges of a model)."""

from __future__ import annotations

import operator
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Any


class StringArray(Sequence[str]):
    """A metadata string array held compactly: its UTF-8 bytes in one blob, and where each
    string ends (4 bytes per string). A vocabulary as a list of Python strings costs ~60
    bytes per token (8 MB for 128k tokens, three times that with Llama 3's merges); this
    costs what the file stores. Items are decoded when read; it reads like a read-only
    list and compares equal to a list of the same strings.
    """

    __slots__ = ("_blob", "_ends")

    def __init__(self, blob: bytes, ends: array) -> None:
        """``ends[i]`` is where string ``i`` ends in ``blob``; ``ends[0]`` is 0."""
        self._blob = blob
        self._ends = ends

    @classmethod
    def of(cls, strings: Iterable[str]) -> StringArray:
        """A StringArray of these strings (for tests and tools)."""
        blob, ends = bytearray(), array("I", [0])
        for text in strings:
            blob += text.encode("utf-8")
            ends.append(len(blob))
        return cls(bytes(blob), ends)

    def __len__(self) -> int:
        return len(self._ends) - 1

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        i = operator.index(index)  # ints and numpy ints; anything else is a TypeError
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("list index out of range")
        return str(self._blob[self._ends[i] : self._ends[i + 1]], "utf-8")

    def __iter__(self) -> Iterator[str]:
        blob, ends = memoryview(self._blob), self._ends
        for i in range(len(ends) - 1):
            yield str(blob[ends[i] : ends[i + 1]], "utf-8")

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StringArray):
            return self._ends == other._ends and self._blob == other._blob
        if isinstance(other, list):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # like a list

    @property
    def nbytes(self) -> int:
        """The bytes it holds (strings and ends)."""
        return len(self._blob) + self._ends.itemsize * len(self._ends)

    def __repr__(self) -> str:
        head = ", ".join(repr(t) for t in self[:3])
        return f"StringArray([{head}{', ...' if len(self) > 3 else ''}], {len(self)} strings)"


#: The types an array value of :attr:`ModelFile.metadata` has: string arrays are
#: :class:`StringArray`, every other array a list.
ARRAY_TYPES = (list, StringArray)
