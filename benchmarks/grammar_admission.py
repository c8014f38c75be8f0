"""Grammars that used to fail or stall inside the engine (issue 43, parts 2 and 3), against `kvpilot serve`.

Starts the server (its own process, the embedded model), then for each case streams one greedy completion of
64 tokens (the "other client") while a second client sends the case's request again and again (--interval
seconds after each answer) until that stream ends. Prints, per case, what the case got (statuses, latency,
the start of the error message) and the stream's TTFT and inter-token times (p50 / p99 / max, ms, of the run
with the median p99 of --runs), next to the same stream alone. A 2-vCPU box is shared by the server, both clients and
the engine: a client sending back to back (--interval 0) measures that sharing more than the server.

    .venv/bin/python benchmarks/grammar_admission.py
    .venv/bin/python benchmarks/grammar_admission.py --case counted_repeat --case min_length_1e9
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import threading
import time
from dataclasses import dataclass, field

import httpx

from server_process import start_server

REF_LOOP = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}
CASES: dict[str, dict] = {
    "counted_repeat": {"guided_regex": "(a{1000}){1000}"},
    "nested_counted_repeats": {"guided_regex": "((a{100}){100}){100}"},
    "regex_1mb": {"guided_regex": "a" * 1_000_000},
    "lark_3000_alternatives": {"guided_grammar": "start: " + " | ".join(f'"w{i}"' for i in range(3000))},
    "choice_10000": {"guided_choice": [f"option {i}" for i in range(10_000)]},
    "ref_loop": {"guided_json": REF_LOOP},
    "min_length_1e9": {"guided_json": {"type": "string", "minLength": 1_000_000_000}},
    "nested_plus": {"guided_regex": "(a+)+$"},
    "min_items_1e6": {"guided_json": {"type": "array", "minItems": 1_000_000}},
    # controls: what any request of 16 tokens next to the stream costs it (no grammar; an ordinary schema)
    "control_plain": {},
    "control_json": {"guided_json": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}},
                                     "required": ["name"]}},
}
STREAM = {"prompt": "The history of the printing press begins with", "max_tokens": 64, "temperature": 0,
          "ignore_eos": True, "stream": True}


@dataclass
class CaseLoad:
    """The case's requests, sent back to back from a thread until `stop` is set."""

    url: str
    fields: dict
    interval_s: float
    stop: threading.Event = field(default_factory=threading.Event)
    statuses: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    message: str = ""

    def run(self) -> None:
        body = json.dumps({"prompt": "Answer:", "max_tokens": 16, "temperature": 0, **self.fields})
        with httpx.Client(base_url=self.url, timeout=600) as http:
            while not self.stop.is_set():
                started = time.monotonic()
                response = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
                self.seconds.append(time.monotonic() - started)
                self.statuses.append(response.status_code)
                if response.status_code != 200:
                    self.message = response.json()["error"]["message"][:150]
                self.stop.wait(self.interval_s)


def stream_gaps(url: str) -> list[float]:
    """The stream's TTFT, then the seconds between its content chunks."""
    started = time.monotonic()
    times: list[float] = []
    with httpx.Client(base_url=url, timeout=600) as http, http.stream("POST", "/v1/completions", json=STREAM) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and '"text":' in line:
                times.append(time.monotonic())
    return [times[0] - started] + [b - a for a, b in zip(times, times[1:])]


def median_run(runs: list[list[float]]) -> list[float]:
    """The run whose p99 gap is the median of the runs'."""
    return sorted(runs, key=lambda run: sorted(run[1:])[int(0.99 * (len(run) - 2))])[len(runs) // 2]


def summary(run: list[float]) -> str:
    ms = sorted(g * 1000 for g in run[1:])
    return (f"ttft {run[0] * 1000:6.1f}  p50 {statistics.median(ms):6.1f}  p99 {ms[int(0.99 * (len(ms) - 1))]:6.1f}  "
            f"max {ms[-1]:6.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", choices=sorted(CASES), help="default: all")
    parser.add_argument("--runs", type=int, default=3, help="runs of the stream, alone and per case")
    parser.add_argument("--interval", type=float, default=0.1, help="seconds between the case's requests")
    parser.add_argument("--log", default=None, help="the server's output goes there")
    args = parser.parse_args()
    process, url = start_server(["--max-model-len", "1024", "--kv-cache-memory", "256MiB"], log_path=args.log)
    try:
        stream_gaps(url)  # warm-up
        print(f"{'alone':24s} {summary(median_run([stream_gaps(url) for _ in range(args.runs)]))}")
        for name in args.case or list(CASES):
            load = CaseLoad(url, CASES[name], args.interval)
            thread = threading.Thread(target=load.run)
            thread.start()
            time.sleep(0.05)  # the case's first request is in flight
            gaps = median_run([stream_gaps(url) for _ in range(args.runs)])
            load.stop.set()
            thread.join()
            codes = ",".join(f"{code}x{load.statuses.count(code)}" for code in sorted(set(load.statuses)))
            print(f"{name:24s} {summary(gaps)} | case: {codes}, {statistics.median(load.seconds) * 1000:.0f} ms "
                  f"median {load.message!r}")
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)


if __name__ == "__main__":
    main()
