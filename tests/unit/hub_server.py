"""A local stand-in for the Hugging Face hub that serves a repository over real HTTP and fails on purpose:
`HF_ENDPOINT` pointed at it makes `datasets.load_dataset(repo, streaming=True)` read a dataset of parquet files from
it, and `huggingface_hub.snapshot_download(repo)` a model's files."""

import hashlib
import http.server
import json
import re
import socket
import threading
import time
from pathlib import Path

COMMIT = "c" * 40


class HubServer:
    """Serves the files under `root` as the main revision of every dataset and model repository; with `gated`,
    every model request is refused as a gated repository's are without an accepted license.

    After the first `fail_after` parquet downloads, the next `fail_429` are answered 429 (Too Many Requests), then
    the next `drop` send half the file and close the connection, then the next `stall` send half the file and stall
    for `stall_seconds` (a read timeout on the client's side); with `always_503` every parquet download after
    `fail_after` is answered 503."""

    def __init__(self, root: Path, fail_after: int = 0, fail_429: int = 0, drop: int = 0, always_503: bool = False,
                 gated: bool = False, stall: int = 0, stall_seconds: float = 1.0):
        self.root, self.fail_after, self.fail_429, self.drop = root, fail_after, fail_429, drop
        self.stall, self.stall_seconds = stall, stall_seconds
        self.always_503, self.gated = always_503, gated
        self.parquet_requests = 0
        # (file name, bytes sent) of every parquet download.
        self.downloads: list[tuple[str, int]] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_HEAD(self):
                server.handle(self, head=True)

            def do_GET(self):
                server.handle(self, head=False)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()

    def files(self) -> list[dict]:
        return [{"type": "file", "path": str(p.relative_to(self.root)), "size": p.stat().st_size,
                 "oid": hashlib.sha1(p.read_bytes()).hexdigest()} for p in sorted(self.root.rglob("*")) if p.is_file()]

    def handle(self, request, head: bool) -> None:
        path = request.path.split("?")[0]
        if self.gated and not path.startswith(("/datasets/", "/api/datasets/")):
            return send(request, 401, json.dumps({"error": "Access to this model is restricted."}),
                        {"X-Error-Code": "GatedRepo"})
        resolve = re.match(r"(/datasets)?/[^/]+/[^/]+/resolve/[^/]+/(.+)", path)
        if resolve:
            return self.serve_file(request, self.root / resolve.group(2), head)
        if re.match(r"/api/(datasets|models)/[^/]+/[^/]+(/revision/[^/]+)?$", path):
            return send(request, 200, json.dumps({"id": "org/data", "sha": COMMIT, "private": False,
                                                  "siblings": [{"rfilename": f["path"]} for f in self.files()]}))
        tree = re.match(r"/api/(datasets|models)/[^/]+/[^/]+/tree/[^/]+/?(.*)", path)
        if tree:
            folder = tree.group(2).rstrip("/")
            recursive = "recursive=true" in request.path
            entries, folders = [], set()
            for f in self.files():
                if folder and not f["path"].startswith(folder + "/"):
                    continue
                rest = f["path"][len(folder) + 1 if folder else 0:]
                if "/" in rest and recursive:
                    entries.append(f)
                    folders.add((folder + "/" if folder else "") + rest.split("/")[0])
                elif "/" in rest:
                    folders.add((folder + "/" if folder else "") + rest.split("/")[0])
                else:
                    entries.append(f)
            entries += [{"type": "directory", "path": d, "oid": "0" * 40, "size": 0} for d in sorted(folders)]
            return send(request, 200, json.dumps(entries))
        send(request, 404, "")

    def serve_file(self, request, file: Path, head: bool) -> None:
        if not file.is_file():
            return send(request, 404, "", {"X-Error-Code": "EntryNotFound"})
        data = file.read_bytes()
        failing = False
        if file.suffix == ".parquet" and not head:
            self.parquet_requests += 1
            failing = self.parquet_requests > self.fail_after
        if failing:
            if self.always_503:
                return send(request, 503, "")
            if self.fail_429 > 0:
                self.fail_429 -= 1
                return send(request, 429, "", {"Retry-After": "0"})
        start, end = 0, len(data) - 1
        if request.headers.get("Range"):
            first, last = request.headers["Range"].split("=")[1].split("-")
            start, end = int(first), min(int(last) if last else end, end)
        body = data[start:end + 1]
        if file.suffix == ".parquet" and not head:
            self.downloads.append((file.name, len(body)))
        headers = {"ETag": f'"{hashlib.sha1(data).hexdigest()}"', "X-Repo-Commit": COMMIT, "Accept-Ranges": "bytes"}
        if request.headers.get("Range"):
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
        request.send_response(206 if request.headers.get("Range") else 200)
        request.send_header("Content-Length", str(len(body)))
        for name, value in headers.items():
            request.send_header(name, value)
        request.end_headers()
        if head:
            return
        if failing and self.drop > 0:
            self.drop -= 1
            request.wfile.write(body[: len(body) // 2])
            request.wfile.flush()
            request.close_connection = True
            request.connection.shutdown(socket.SHUT_RDWR)
            return
        if failing and self.stall > 0:
            self.stall -= 1
            request.wfile.write(body[: len(body) // 2])
            request.wfile.flush()
            time.sleep(self.stall_seconds)
            request.close_connection = True
            return
        request.wfile.write(body)


def send(request, status: int, body: str, headers: dict | None = None) -> None:
    data = body.encode()
    request.send_response(status)
    request.send_header("Content-Length", str(len(data)))
    request.send_header("Content-Type", "application/json")
    for name, value in (headers or {}).items():
        request.send_header(name, value)
    request.end_headers()
    request.wfile.write(data)
