"""Enable apt components (contrib non-free …) by editing the host's own entries: no new mirror is named, the
entries already there are extended. Pure text in, text out; one-line and deb822 formats. Only entries of the
distro itself are touched: those for this release's suites that carry `main` (not third-party repositories)."""
from __future__ import annotations

import re

ONE_LINE = re.compile(r"^(\s*deb(?:-src)?\s+(?:\[[^\]]*\]\s+)?\S+\s+(\S+))((?:\s+\S+)*)\s*$")


def _extend(comps: list[str], wanted: tuple[str, ...]) -> list[str]:
    return comps + [c for c in wanted if c not in comps]


def enable_components(text: str, wanted: tuple[str, ...], codename: str) -> str:
    if re.search(r"^\s*Types:", text, re.M):  # deb822 (.sources)
        stanzas = re.split(r"(\n\s*\n)", text)
        out = []
        for st in stanzas:
            suites = re.search(r"^Suites:\s*(.*)$", st, re.M)
            comps = re.search(r"^Components:\s*(.*)$", st, re.M)
            if suites and comps and "main" in comps.group(1).split() and any(
                    s.startswith(codename) for s in suites.group(1).split()):
                new = " ".join(_extend(comps.group(1).split(), wanted))
                st = st[:comps.start()] + f"Components: {new}" + st[comps.end():]
            out.append(st)
        return "".join(out)
    out = []
    for line in text.splitlines(keepends=True):
        m = ONE_LINE.match(line.rstrip("\n"))
        if m and m.group(2).startswith(codename) and "main" in m.group(3).split():
            line = f"{m.group(1)} {' '.join(_extend(m.group(3).split(), wanted))}\n"
        out.append(line)
    return "".join(out)
