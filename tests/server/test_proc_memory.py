"""/proc parsing for the memory series of /metrics (process resident/swapped bytes, major faults, host
swap): fixed text, a fake /proc directory, and the live /proc where there is one."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.server.observe.metrics import MemoryCollector, ServerMetrics
from kvpilot.server.observe.proc_memory import (HostSwap, ProcessMemory, kb_fields, parse_host_swap, parse_major_faults,
                                        parse_process_memory, read_host_swap, read_process_memory)

STATUS = """Name:\tpython
Umask:\t0022
State:\tS (sleeping)
VmPeak:\t 1543976 kB
VmRSS:\t  714108 kB
RssAnon:\t  610268 kB
VmSwap:\t  318420 kB
Threads:\t4
"""
# comm may hold spaces and parentheses: fields are counted after the last ')'
STAT = "22514 (python (kv) 3) S 22500 22514 22500 0 -1 4194560 456460 0 2202 0 10485 2300 0 0 20 0 4 0 100"
MEMINFO = """MemTotal:       24684132 kB
MemFree:        19071744 kB
SwapCached:         8448 kB
SwapTotal:       2097148 kB
SwapFree:        1772092 kB
HugePages_Total:       0
"""


def test_kb_fields_are_bytes() -> None:
    fields = kb_fields(STATUS)
    assert fields["VmRSS"] == 714108 * 1024 and fields["VmSwap"] == 318420 * 1024
    assert "Threads" not in fields and "Name" not in fields


def test_process_memory_from_status_and_stat() -> None:
    mem = parse_process_memory(STATUS, STAT)
    assert mem == ProcessMemory(resident_bytes=714108 * 1024, swap_bytes=318420 * 1024, major_faults=2202)
    assert parse_process_memory(STATUS) == ProcessMemory(714108 * 1024, 318420 * 1024, None)


def test_kernel_without_swap_support_reports_no_vmswap() -> None:
    mem = parse_process_memory("VmRSS:\t 1024 kB\n")
    assert mem == ProcessMemory(1024 * 1024, None, None)


@pytest.mark.parametrize("text", ["", "not a status file", "Name:\tkthreadd\nState:\tS\n"])
def test_status_without_memory_fields_is_none(text: str) -> None:
    assert parse_process_memory(text, STAT) is None


@pytest.mark.parametrize("text", ["", "1 (x) S 0", "garbage without parens", "1 (x) S 0 1 1 0 -1 0 5 0 n/a"])
def test_malformed_stat_has_no_major_faults(text: str) -> None:
    assert parse_major_faults(text) is None


def test_host_swap_from_meminfo() -> None:
    swap = parse_host_swap(MEMINFO)
    assert swap == HostSwap(2097148 * 1024, 1772092 * 1024)
    assert swap is not None and swap.used_bytes == (2097148 - 1772092) * 1024
    assert parse_host_swap("SwapTotal:       0 kB\nSwapFree:        0 kB\n") == HostSwap(0, 0)
    assert parse_host_swap("MemTotal: 1 kB\n") is None


def test_readers_on_a_fake_proc(tmp_path: Path) -> None:
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "status").write_text(STATUS)
    (tmp_path / "42" / "stat").write_text(STAT)
    (tmp_path / "meminfo").write_text(MEMINFO)
    assert read_process_memory("42", tmp_path) == parse_process_memory(STATUS, STAT)
    assert read_host_swap(tmp_path) == parse_host_swap(MEMINFO)
    # a system without /proc: no values, no exception
    assert read_process_memory("self", tmp_path / "missing") is None and read_host_swap(tmp_path / "missing") is None


def _exposed(collector: MemoryCollector) -> dict[str, float]:
    registry = CollectorRegistry()
    registry.register(collector)
    return {s.name: s.value for f in text_string_to_metric_families(generate_latest(registry).decode())
            for s in f.samples}


def test_collector_exports_what_proc_says() -> None:
    collector = MemoryCollector(lambda: parse_process_memory(STATUS, STAT), lambda: parse_host_swap(MEMINFO))
    assert _exposed(collector) == {
        "kvpilot:process_resident_bytes": 714108 * 1024, "kvpilot:process_swap_bytes": 318420 * 1024,
        "kvpilot:process_major_page_faults_total": 2202, "kvpilot:host_swap_total_bytes": 2097148 * 1024,
        "kvpilot:host_swap_free_bytes": 1772092 * 1024}


def test_collector_without_proc_exports_nothing() -> None:
    assert _exposed(MemoryCollector(lambda: None, lambda: None)) == {}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")
def test_server_metrics_read_this_process() -> None:
    values = {s.name: s.value for f in text_string_to_metric_families(
        ServerMetrics("m", lambda: None).render().decode()) for s in f.samples}
    assert values["kvpilot:process_resident_bytes"] > 10 * 2**20  # a Python process with prometheus-client
    assert values["kvpilot:process_swap_bytes"] >= 0 and values["kvpilot:process_major_page_faults_total"] >= 0
    assert 0 <= values["kvpilot:host_swap_free_bytes"] <= values["kvpilot:host_swap_total_bytes"]
