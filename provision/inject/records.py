"""The runtime's light records: immutable, compared by value (tuples with named fields). Neither dataclasses nor
namedtuples: these modules are imported by every cold GPU start (`python3 -I -S modify_main.py`), where building a
frozen dataclass costs 0.5-4 ms and a namedtuple subclass ~60 us at import; one of these ~8 us (python -I -S, here).
Used by edits.py (what a container gets) and mig.py (MIG instances)."""
from __future__ import annotations

from operator import itemgetter


class Record(tuple):
    """A tuple whose items are named by FIELDS (each one a read-only property, from fields())."""
    __slots__ = ()
    FIELDS: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in zip(self.FIELDS, self))})"


def fields(*names: str) -> tuple[property, ...]:
    """A Record's field properties, in FIELDS' order."""
    return tuple(property(itemgetter(i), doc=name) for i, name in enumerate(names))
