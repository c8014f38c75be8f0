"""Summarizes a `py-spy record --format raw --threads` file (folded stacks: `frame;frame;... count`; py-spy
leaves idle threads out unless --idle): per process and thread, its busy seconds (samples / rate) and the
busiest frames, by own samples and by samples under them.

    .venv/bin/python benchmarks/pyspy_summary.py server.txt [--top 25] [--rate 200]
"""

from __future__ import annotations

import argparse
import collections


def _label(frames: list[str]) -> str:
    """The leading "process PID:cmd" / "thread (ID): name" frames, shortened."""
    heads = []
    for frame in frames:
        if not frame.startswith(("process ", "thread ")):
            break
        heads.append(frame.split(":")[0] + (":" + frame.split(":", 2)[-1].strip()[:40] if frame.startswith("thread")
                                             else ""))
    return " / ".join(heads) or "all"


def summarize(path: str, top: int, rate: float) -> str:
    own: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    under: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    totals: collections.Counter[str] = collections.Counter()
    for line in open(path, encoding="utf-8"):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames, n = stack.split(";"), int(count)
        key = _label(frames)
        totals[key] += n
        own[key][frames[-1]] += n
        for frame in set(frames):
            if not frame.startswith(("process ", "thread ")):
                under[key][frame] += n
    lines = []
    for key, total in totals.most_common():
        lines.append(f"== {key}: {total} samples, ~{total / rate:.1f} s busy")
        lines.extend(f"   own {n:6d}  {frame}" for frame, n in own[key].most_common(top))
        lines.extend(f"   all {n:6d}  {frame}" for frame, n in under[key].most_common(top))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--rate", type=float, default=200.0, help="py-spy's --rate (server_overhead.py: 200)")
    args = parser.parse_args()
    print(summarize(args.path, args.top, args.rate))


if __name__ == "__main__":
    main()
