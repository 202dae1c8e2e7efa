"""Rendering: JSON on stdout for machines, compact tables for people, errors on stderr."""
from __future__ import annotations

import json
import sys
from typing import Iterable, Sequence


def emit_json(doc) -> None:
    sys.stdout.write(json.dumps(doc, indent=2, sort_keys=False) + "\n")


def table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    rows = [["-" if c is None or c == "" else str(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(headers), *(line(r) for r in rows)])


def kv(pairs: Iterable[tuple[str, object]]) -> str:
    pairs = [(k, "-" if v is None or v == "" else str(v)) for k, v in pairs]
    w = max((len(k) for k, _ in pairs), default=0)
    return "\n".join(f"{k.ljust(w)}  {v}" for k, v in pairs)


def print_steps(title: str, steps: list[dict], verbose: bool = False) -> None:
    """A plan as people read it (`plan`, `bootstrap --dry-run`, `uninstall --dry-run`, the prompt before a run):
    each step (a Step.to_dict) in a few lines: its title, the check that skips it, and one line of what it does
    (Step.effect). `verbose` (-v) adds every command, every file diff and the step's notes: what --json holds too.
    Lines fit 100 columns (progress.WIDTH): words wrap, a command breaks between shell words with ` \\` (pasted, it
    is the same command); a diff's lines are the file's own."""
    from provision.progress import wrap, wrap_command  # lazy: textwrap 1.5 ms (-X importtime); plans only, not detect

    print(f"{title} ({counted(len(steps), 'step')}):")
    for i, s in enumerate(steps, 1):
        print("\n".join(wrap(f"{i:2}. {s['title']}{'  [reboot]' if s['reboot'] else ''}  ({s['check']})")))
        if not verbose:
            print("\n".join(wrap("      " + s["effect"], "        ")))
            continue
        for line in s["actions"]:
            if line.lstrip().startswith("$ "):  # (a roll-back's commands are indented under their step's)
                print("\n".join(wrap_command(line.lstrip(), "      " + line[:len(line) - len(line.lstrip())])))
            else:
                print("\n".join(wrap("      " + line, "        ")))
        for note in s.get("notes", ()):
            print("\n".join(wrap("      note: " + note, "        ")))
        for p, diff in s.get("diffs", {}).items():
            print(diff.rstrip("\n") if diff else f"      (file {p} unchanged)")
    if steps and not verbose:
        print("(-v: every command and file diff; --json: the same as data)")


def counted(n: int, noun: str) -> str:
    """`1 step`, `2 steps`."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def progress(msg: str) -> None:
    """Progress lines go to stderr so --json output on stdout stays machine-readable."""
    print(msg, file=sys.stderr, flush=True)
