"""Enable apt components (contrib non-free …) by editing the host's own entries: no new mirror is named, the
entries already there are extended. Pure text in, text out; one-line and deb822 formats. Only entries of the
distro itself are touched: those for this release's suites that carry `main` (not third-party repositories).

A component is added to an entry only where no entry of the same type, URI and suite has it already, in any of the
host's source files (`present`): stock Ubuntu 22.04 names `multiverse` on lines of its own, and appending it to the
`main restricted` lines too made every later `apt-get update` warn "configured multiple times" (issue 43)."""
from __future__ import annotations

import re

ONE_LINE = re.compile(r"^(\s*(deb(?:-src)?)\s+(?:\[[^\]]*\]\s+)?(\S+)\s+(\S+))((?:\s+\S+)*)\s*$")
Source = tuple[str, str, str]  # (type, URI, suite): what apt tells one entry's components apart by


def _uri(u: str) -> str:
    return u.rstrip("/")


def _stanzas(text: str) -> list[str]:
    return re.split(r"(\n\s*\n)", text)


def _field(stanza: str, name: str) -> re.Match | None:
    return re.search(rf"^{name}:\s*(.*)$", stanza, re.M)


def _deb822(text: str) -> bool:
    return bool(re.search(r"^\s*Types:", text, re.M))


def _entries(text: str):
    """Each entry of `text` as (its sources, its components, where its components are: a match of the line or of the
    Components field). Comments and disabled stanzas (Enabled: no) name none."""
    if _deb822(text):
        for st in _stanzas(text):
            types, uris, suites, comps = (_field(st, f) for f in ("Types", "URIs", "Suites", "Components"))
            enabled = _field(st, "Enabled")
            if not (types and uris and suites and comps) or enabled and enabled.group(1).strip().lower() == "no":
                continue
            yield ([(t, _uri(u), s) for t in types.group(1).split() for u in uris.group(1).split()
                    for s in suites.group(1).split()], comps.group(1).split())
        return
    for line in text.splitlines():
        m = ONE_LINE.match(line)
        if m:
            yield [(m.group(2), _uri(m.group(3)), m.group(4))], m.group(5).split()


def components_present(texts: list[str]) -> dict[Source, set[str]]:
    """Per (type, URI, suite), the components the entries of all `texts` (the host's source files) enable."""
    out: dict[Source, set[str]] = {}
    for text in texts:
        for sources, comps in _entries(text):
            for s in sources:
                out.setdefault(s, set()).update(comps)
    return out


def _missing(sources: list[Source], comps: list[str], wanted: tuple[str, ...],
             present: dict[Source, set[str]]) -> list[str]:
    """The `wanted` components that this entry and every other entry of its sources lack."""
    add = [c for c in wanted if c not in comps and not any(c in present.get(s, ()) for s in sources)]
    for s in sources:
        present.setdefault(s, set()).update(add)
    return add


def enable_components(text: str, wanted: tuple[str, ...], codename: str,
                      present: dict[Source, set[str]] | None = None) -> str:
    """`text` with `wanted` added to its entries of this release that carry `main`, where missing from every entry of
    the same source (`present`: components_present of all the host's source files; default: this file's)."""
    # a copy, each addition noted in it: a second entry of the same source gets no second copy of a component
    present = {s: set(c) for s, c in (components_present([text]) if present is None else present).items()}
    if _deb822(text):
        out = []
        for st in _stanzas(text):
            types, uris, suites, comps = (_field(st, f) for f in ("Types", "URIs", "Suites", "Components"))
            if types and uris and suites and comps and "main" in comps.group(1).split() and any(
                    s.startswith(codename) for s in suites.group(1).split()):
                have = comps.group(1).split()
                sources = [(t, _uri(u), s) for t in types.group(1).split() for u in uris.group(1).split()
                           for s in suites.group(1).split()]
                add = _missing(sources, have, wanted, present)
                if add:
                    st = st[:comps.start()] + f"Components: {' '.join(have + add)}" + st[comps.end():]
            out.append(st)
        return "".join(out)
    out = []
    for line in text.splitlines(keepends=True):
        m = ONE_LINE.match(line.rstrip("\n"))
        if m and m.group(4).startswith(codename) and "main" in m.group(5).split():
            have = m.group(5).split()
            add = _missing([(m.group(2), _uri(m.group(3)), m.group(4))], have, wanted, present)
            if add:
                line = f"{m.group(1)} {' '.join(have + add)}\n"
        out.append(line)
    return "".join(out)
