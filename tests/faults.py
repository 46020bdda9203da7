"""A real HTTP server on 127.0.0.1 that misbehaves on purpose, for the fault tests: it serves the files of a folder with
Range, If-Range, a strong ETag and Last-Modified, as object stores do, and plays faults on the GETs its rules match.

Faults: "cut" (the headers with the full length, half the body, then the connection drops), "stall" (half the body,
then silence for `stall` seconds, then the connection drops), "reset" (the connection drops before any answer),
"rewrite" (a cut, and the file is rewritten, same size, other bytes, before the next request), or an HTTP status
(503 and 429 come with `Retry-After`). A rule applies to the paths matching its glob, on the first GET of each path
("first"), on the first GET with a Range of each path ("ranged"), on every GET without a Range ("fresh"), or on every
GET ("always"), at most `times` times in all."""
import email.utils, fnmatch, hashlib, http.server, os, socket, threading, time
from pathlib import Path


class FaultServer:
    "Serves `root` on 127.0.0.1 (a free port), playing the faults of its rules; `log` has every request."
    def __init__(self, root, etag: bool = True):
        self.root, self.etag, self.rules, self.log, self.gets = Path(root), etag, [], [], {}
        self.lock, self.quit = threading.Lock(), threading.Event()
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.httpd.daemon_threads = True
        self.httpd.handle_error = lambda request, address: None  # a client that went away (it timed out) is no error
        threading.Thread(target=self.httpd.serve_forever, kwargs=dict(poll_interval=0.05), daemon=True).start()
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def url(self, name: str) -> str: return f"{self.base}/{name}"
    def urls(self, names) -> list[str]: return [self.url(n) for n in names]

    def fault(self, kind, pattern: str = "*", when: str = "first", times: int | None = None, retry_after: float = 1,
              stall: float = 3.0) -> "FaultServer":
        "Play `kind` on the GETs of paths matching `pattern` (`when`: first, ranged, fresh, always), at most `times`."
        assert when in ("first", "ranged", "fresh", "always"), when
        with self.lock:
            self.rules.append(dict(kind=kind, pattern=pattern, when=when, left=times, retry_after=retry_after,
                                   stall=stall))
        return self

    def clear(self):
        "No more faults; forget which paths were asked for (so 'first' applies afresh)."
        with self.lock: self.rules, self.gets = [], {}

    def faults_played(self) -> list[tuple]: return [r for r in self.log if r[3] is not None]

    def _pick(self, path: str, ranged: bool):
        with self.lock:
            n = self.gets[path] = self.gets.get(path, 0) + 1
            if ranged: m = self.gets[path, "ranged"] = self.gets.get((path, "ranged"), 0) + 1
            for r in self.rules:
                if not fnmatch.fnmatchcase(path, "/" + r["pattern"].lstrip("/")) or r["left"] == 0: continue
                if (r["when"] == "first" and n > 1) or (r["when"] == "fresh" and ranged): continue
                if r["when"] == "ranged" and not (ranged and m == 1): continue
                if r["left"] is not None: r["left"] -= 1
                return r
        return None

    def close(self):
        self.quit.set(); self.httpd.shutdown(); self.httpd.server_close()
    def __enter__(self): return self
    def __exit__(self, *exc): self.close()


def _handler(server: FaultServer):
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # headers and body in separate writes would wait for a delayed ACK (40 ms)
        def log_message(self, *args): pass

        def do_HEAD(self): self._serve(body=False)
        def do_GET(self): self._serve(body=True)

        def _status(self, code: int, retry_after=None):
            self.send_response(code)
            if retry_after is not None and code in (429, 503): self.send_header("Retry-After", f"{retry_after:g}")
            self.send_header("Content-Length", "0"); self.end_headers()

        def _drop(self):
            self.close_connection = True
            try: self.connection.shutdown(socket.SHUT_RDWR)
            except OSError: pass

        def _serve(self, body: bool):
            path = self.path.split("?", 1)[0]
            rng = self.headers.get("Range")
            rule = server._pick(path, bool(rng)) if body else None
            kind = rule["kind"] if rule else None
            server.log.append((self.command, path, rng, kind, time.monotonic()))
            if isinstance(kind, int): return self._status(kind, rule["retry_after"])
            if kind == "reset": return self._drop()
            f = (server.root / path.lstrip("/")).resolve()
            if server.root.resolve() not in f.parents or not f.is_file(): return self._status(404)
            data = f.read_bytes()
            tag = f'"{hashlib.sha1(data).hexdigest()[:20]}"'
            a, b = 0, len(data) - 1
            partial = bool(rng) and (not server.etag or self.headers.get("If-Range", tag) == tag)
            if partial:  # a changed object (If-Range no longer matches) comes whole, as HTTP says
                lo, hi = rng.removeprefix("bytes=").split("-")
                a, b = int(lo), min(int(hi), len(data) - 1) if hi else len(data) - 1
            self.send_response(206 if partial else 200)
            self.send_header("Content-Length", str(b + 1 - a)); self.send_header("Accept-Ranges", "bytes")
            if server.etag: self.send_header("ETag", tag)
            self.send_header("Last-Modified", email.utils.formatdate(os.stat(f).st_mtime, usegmt=True))
            if partial: self.send_header("Content-Range", f"bytes {a}-{b}/{len(data)}")
            self.end_headers()
            if not body: return
            if kind in ("cut", "stall", "rewrite"):
                try:
                    self.wfile.write(data[a:a + (b + 1 - a) // 2]); self.wfile.flush()
                    if kind == "stall": server.quit.wait(rule["stall"])
                except OSError: pass
                if kind == "rewrite": f.write_bytes(data[::-1])
                return self._drop()
            try: self.wfile.write(data[a:b + 1])
            except OSError: pass  # the client went away (it timed out, or stopped reading)
    return Handler
