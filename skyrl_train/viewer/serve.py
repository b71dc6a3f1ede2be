"""Serving the page from 127.0.0.1: the same files as the offline page, except that
the manifest is built on each request (a reload shows a running run's new steps) and a
dump is read when the page asks for its step, never all at once.

Only the loopback address is served: the page shows prompts, replies and file paths,
and nothing here authenticates a client.
"""

from __future__ import annotations

import re
import sys
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import orjson

from skyrl_train.errors import SkyRLTrainError
from skyrl_train.runs.rollouts import dump_path
from skyrl_train.viewer.inputs import NotARunError, load_runs
from skyrl_train.viewer.site import MANIFEST, asset_files, dump_script, manifest_script

LOOPBACK = ("127.0.0.1", "localhost")
_DUMP_URL = re.compile(r"^data/r(\d+)/(train|eval)_(\d{6,})\.js$")
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8"}
_TYPES[".css"] = "text/css; charset=utf-8"


class NotLoopbackError(SkyRLTrainError, ValueError):
    """A host to serve on that is not this machine's loopback address."""


def check_host(host: str) -> str:
    if host not in LOOPBACK:
        raise NotLoopbackError(
            f"--host: expected 127.0.0.1 (the viewer serves this machine only), got {host!r}"
        )
    return "127.0.0.1"


def make_server(
    paths: list[Path], *, host: str = "127.0.0.1", port: int = 0
) -> ThreadingHTTPServer:
    """A server of the page for ``paths`` (checked as run folders first); ``port`` 0
    takes a free one (``server.server_address`` says which)."""
    bind = check_host(host)
    load_runs(paths)  # a folder that is not a run is refused before anything listens
    assets = asset_files()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            name = self.path.split("?", 1)[0].lstrip("/") or "index.html"
            if name == MANIFEST:
                # Read again on each load: a reload shows a running run's new steps.
                try:
                    self._send(manifest_script(load_runs(paths), mode="serve"), ".js")
                except NotARunError as exc:  # the folder went away since the start
                    message = orjson.dumps(f"view: {exc}")
                    self._send(b"window.__skyrlManifestError = " + message + b";\n", ".js")
            elif name in assets:
                self._asset(assets[name])
            elif match := _DUMP_URL.match(name):
                self._dump(int(match.group(1)), match.group(2), int(match.group(3)))
            else:
                self.send_error(HTTPStatus.NOT_FOUND, f"{name}: not part of the viewer")

        def _dump(self, index: int, kind: str, step: int) -> None:
            if index >= len(paths):
                self.send_error(HTTPStatus.NOT_FOUND, f"no run r{index}")
                return
            script, problem = dump_script(index, kind, step, dump_path(paths[index], step, kind))
            if problem:
                print(f"view: warning: {problem}", file=sys.stderr, flush=True)
            self._send(script, ".js")

        def _asset(self, path: Path) -> None:
            # Revalidated, not re-sent: a cached plotly.min.js keeps the browser's
            # compiled copy, which saves most of a second per page load.
            stamp = f'"{path.stat().st_mtime_ns}-{path.stat().st_size}"'
            if self.headers.get("If-None-Match") == stamp:
                self.send_response(HTTPStatus.NOT_MODIFIED)
                self.send_header("ETag", stamp)
                self.end_headers()
                return
            self._send(path.read_bytes(), path.suffix, etag=stamp)

        def _send(self, body: bytes, suffix: str, *, etag: str | None = None) -> None:
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", _TYPES.get(suffix, "application/octet-stream"))
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store" if etag is None else "no-cache")
            if etag is not None:
                self.send_header("ETag", etag)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass  # one line per request would bury the warnings

    return _Server((bind, port), Handler)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a tab closed mid-reply
            super().handle_error(request, client_address)


def serve(paths: list[Path], *, host: str, port: int) -> None:
    """Serve until Ctrl-C, printing the URL first."""
    server = make_server(paths, host=host, port=port)
    address, bound = server.server_address[:2]
    print(f"serving http://{address!s}:{bound}/ (Ctrl-C to stop)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
