"""The medians of scripts/serve_ab.sh's rounds, one row a figure and one column a server, as a Markdown table.

    python scripts/serve_ab_table.py OUT [SERVER ...]

Figures: output tok/s of 1 stream (baseline), 8 and 32 (burst8, burst32), 32 sampled (sampled32); prompt tok/s of
the prefill probe (its prompt tokens over its duration, 2 tokens out); the long probe's first token (median TTFT, s)
and the decode after it (median inter-token latency, ms). Each cell: the median over the rounds, and the range where
there are several.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

FIGURES = {
    "1 stream, tok/s": ("baseline", lambda s: s["output_throughput"]),
    "8 streams, tok/s": ("burst8", lambda s: s["output_throughput"]),
    "32 streams, tok/s": ("burst32", lambda s: s["output_throughput"]),
    "32 streams sampled (T 0.7, top_p 0.9), tok/s": ("sampled32", lambda s: s["output_throughput"]),
    "prefill, prompt tok/s": ("prefill", lambda s: s["prompt_tokens"] / s["duration_s"]),
    "long prompt: first token, s": ("long", lambda s: s["ttft_ms"]["p50"] / 1e3),
    "long prompt: decode, ms/token (p50)": ("long", lambda s: s["itl_ms"]["p50"]),
}


def main() -> None:
    out, *servers = sys.argv[1:]
    found: dict[tuple[str, str], list[float]] = defaultdict(list)
    names: list[str] = []
    for path in sorted(Path(out).glob("*-r*-*.json")):
        server, rest = path.stem.rsplit("-r", 1)
        workload = rest.split("-", 1)[1]
        summary = json.loads(path.read_text())["summary"]
        if summary["completed"] == 0:
            continue
        names += [server] if server not in names else []
        for figure, (name, value) in FIGURES.items():
            if name == workload:
                found[figure, server].append(value(summary))
    servers = servers or names
    print("| figure | " + " | ".join(servers) + " |")
    print("|---|" + "---|" * len(servers))
    for figure in FIGURES:
        cells = []
        for server in servers:
            values = found.get((figure, server), [])
            if not values:
                cells.append("")
                continue
            median = statistics.median(values)
            spread = f" ({min(values):.3g}-{max(values):.3g})" if len(values) > 1 else ""
            cells.append(f"{median:.3g}{spread}")
        print(f"| {figure} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
