"""A stand-in for `nvidia-smi --query-gpu=FIELDS --format=csv[,noheader][,nounits]`, answering from the real H200
host's capture (tests/fixtures/hosts/h200-vm/commands/query-gpu.csv, whose header names the fields). NVML, which
nvidia-smi asks, cannot exist on a machine without an NVIDIA GPU; this is its boundary. A field the capture lacks is
refused as nvidia-smi refuses it (exit 2). inject_helpers.driver_root_with_smi installs it as a driver root's
bin/nvidia-smi."""
import sys
from pathlib import Path

CSV = Path(__file__).resolve().parent / "fixtures/hosts/h200-vm/commands/query-gpu.csv"
XML = CSV.parent / "nvidia-smi-q.xml"


def main(argv: list[str]) -> int:
    if argv == ["-q", "-x"]:  # the XML report, as captured
        sys.stdout.write(XML.read_text())
        return 0
    query = next((a.split("=", 1)[1] for a in argv if a.startswith("--query-gpu=")), None)
    fmt = next((a.split("=", 1)[1] for a in argv if a.startswith("--format=")), "")
    if query is None or not fmt.startswith("csv"):
        print("fake nvidia-smi: only -q -x and --query-gpu=… --format=csv… are captured", file=sys.stderr)
        return 2
    header, *rows = [[c.strip() for c in line.split(",")] for line in CSV.read_text().splitlines() if line.strip()]
    names = [h.split(" [")[0] for h in header]  # "memory.total [MiB]" -> "memory.total"
    fields = query.split(",")
    for f in fields:
        if f not in names:
            print(f'Field "{f}" is not a valid field to query.', file=sys.stderr)
            return 2
    if "noheader" not in fmt:
        print(", ".join(header[names.index(f)] for f in fields))
    for row in rows:
        values = [row[names.index(f)] for f in fields]
        if "nounits" in fmt:
            values = [v.split(" ")[0] for v in values]
        print(", ".join(values))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
