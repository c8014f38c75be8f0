"""A local stand-in for the Hugging Face Hub: the routes huggingface_hub calls to download a model repository
(model info, tree listing, resolve with HEAD/GET and byte ranges), served on loopback for HF_ENDPOINT.

Repositories are in-memory: name -> branch -> commit -> files. It counts file downloads (cache reuse), can
cut one download short once (resume), and answers 401/404 with the Hub's error codes (gated, private,
missing repository or revision).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse


@dataclass
class StandinRepo:
    """One repository: each branch or tag points at a commit (40 hex chars) holding files."""

    commits: dict[str, dict[str, bytes]]
    refs: dict[str, str]
    gated: bool = False
    private_token: str | None = None  # when set, only this bearer token sees the repository


@dataclass
class HubState:
    repos: dict[str, StandinRepo] = field(default_factory=dict)
    downloads: Counter = field(default_factory=Counter)  # file name -> full or ranged GETs
    cut_once: dict[str, int] = field(default_factory=dict)  # file name -> bytes to send before cutting
    ranges: list[str] = field(default_factory=list)  # Range headers seen on GETs


def commit_id(label: str) -> str:
    return hashlib.sha1(label.encode()).hexdigest()


def make_repo(files_by_ref: dict[str, dict[str, bytes]], **kwargs) -> StandinRepo:
    commits = {commit_id(ref): files for ref, files in files_by_ref.items()}
    return StandinRepo(commits=commits, refs={ref: commit_id(ref) for ref in files_by_ref}, **kwargs)


class _Handler(BaseHTTPRequestHandler):
    state: HubState
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    def _error(self, status: int, code: str, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, payload) -> None:
        body = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _repo(self, name: str) -> StandinRepo | None:
        repo = self.state.repos.get(name)
        auth = self.headers.get("Authorization", "")
        if repo is None or (repo.private_token and auth != f"Bearer {repo.private_token}"):
            self._error(401, "RepoNotFound", "Repository Not Found")
            return None
        if repo.gated and not auth:
            self._error(401, "GatedRepo", "Access to this repository is restricted")
            return None
        return repo

    def _commit(self, repo: StandinRepo, ref: str) -> str | None:
        ref = unquote(ref)
        commit = repo.refs.get(ref) or (ref if ref in repo.commits else None)
        if commit is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {ref}")
        return commit

    def do_GET(self) -> None:
        self._route()

    def do_HEAD(self) -> None:
        self._route()

    def _route(self) -> None:
        path = urlparse(self.path).path
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/(.+))?", path):
            return self._info(m[1], m[2] or "main")
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/.*)?", path):
            return self._tree(m[1], m[2])
        if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
            return self._resolve(m[1], m[2], unquote(m[3]))
        self._error(404, "EntryNotFound", f"no route {path}")

    def _info(self, name: str, ref: str) -> None:
        if (repo := self._repo(name)) is None or (commit := self._commit(repo, ref)) is None:
            return
        files = repo.commits[commit]
        self._json({"id": name, "modelId": name, "sha": commit, "private": bool(repo.private_token),
                    "gated": repo.gated, "siblings": [{"rfilename": f} for f in sorted(files)]})

    def _tree(self, name: str, ref: str) -> None:
        if (repo := self._repo(name)) is None or (commit := self._commit(repo, ref)) is None:
            return
        self._json([{"type": "file", "path": f, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                    for f, data in sorted(repo.commits[commit].items())])

    def _resolve(self, name: str, ref: str, filename: str) -> None:
        if (repo := self._repo(name)) is None or (commit := self._commit(repo, ref)) is None:
            return
        data = repo.commits[commit].get(filename)
        if data is None:
            return self._error(404, "EntryNotFound", f"{filename} does not exist")
        start = 0
        if self.command == "GET":
            self.state.downloads[filename] += 1
            if (rng := self.headers.get("Range")) is not None:
                self.state.ranges.append(rng)
                start = int(re.match(r"bytes=(\d+)-", rng)[1])
        body = data[start:]
        self.send_response(206 if start else 200)
        self.send_header("X-Repo-Commit", commit)
        self.send_header("ETag", f'"{hashlib.sha1(data).hexdigest()}"')
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(len(body)))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if self.command == "HEAD":
            return
        cut = self.state.cut_once.pop(filename, None)
        if cut is not None:  # send part of the file, then drop the connection
            self.wfile.write(body[:cut])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)
            return
        self.wfile.write(body)


class StandinHub:
    """The server; `url` is what HF_ENDPOINT should be. Use as a context manager."""

    def __init__(self) -> None:
        self.state = HubState()
        handler = type("Handler", (_Handler,), {"state": self.state})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> StandinHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
