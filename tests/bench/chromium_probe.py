"""Headless Chromium behind a recording proxy: what a page requests and what DOM it renders."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

# Chromium's own background services, which it may contact whatever the page does.
CHROMIUM_SERVICE_HOSTS = ("google.com", "googleapis.com", "gvt1.com", "gstatic.com")


@dataclass(frozen=True)
class Probe:
    dom: str
    requested_hosts: tuple[str, ...]

    def page_hosts(self) -> list[str]:
        return [h for h in self.requested_hosts
                if not any(h == s or h.endswith("." + s) for s in CHROMIUM_SERVICE_HOSTS)]


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _host(first_bytes: bytes) -> str:
    # "CONNECT host:443 HTTP/1.1" or "GET http://host/path HTTP/1.1"
    parts = first_bytes.decode("latin-1").split(" ")
    target = parts[1] if len(parts) > 1 else ""
    target = target.split("://", 1)[-1]
    return target.split("/", 1)[0].rsplit(":", 1)[0]


def probe(html_file: Path, timeout_s: float = 60.0) -> Probe:
    """Load ``html_file`` in headless Chromium with every request routed to a local listener."""
    hosts: list[str] = []
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2.0)
                try:
                    hosts.append(_host(conn.recv(256)))
                except OSError:
                    pass

    threading.Thread(target=accept, daemon=True).start()
    try:
        with tempfile.TemporaryDirectory() as profile:
            proc = subprocess.run(
                [str(chromium_path()), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", f"--user-data-dir={profile}",
                 f"--proxy-server=http://127.0.0.1:{listener.getsockname()[1]}",
                 "--proxy-bypass-list=<-loopback>", "--virtual-time-budget=5000", "--dump-dom",
                 html_file.resolve().as_uri()],
                capture_output=True, text=True, timeout=timeout_s, check=False)
    finally:
        listener.close()
    return Probe(proc.stdout, tuple(hosts))
