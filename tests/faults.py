"""A real HTTP server on 127.0.0.1 that misbehaves on purpose, for the fault tests: it serves the files of a folder with
Range, If-Range, a strong ETag and Last-Modified, as object stores do, and plays faults on the GETs its rules match.

Faults: "cut" (the headers with the full length, half the body, then the connection drops), "stall" (half the body,
then silence for `stall` seconds, then the connection drops), "reset" (the connection drops before any answer),
"rewrite" (a cut, and the file is rewritten, same size, other bytes, before the next request), or an HTTP status
(503 and 429 come with `Retry-After`). A rule applies to the paths matching its glob, on the first GET of each path
("first"), on the first GET with a Range of each path ("ranged"), on every GET without a Range ("fresh"), or on every
GET ("always"), at most `times` times in all.

With `s3=True` it speaks enough of S3's API for the S3 fault cases: the first part of a path is a bucket (a folder of
`root`), ListObjectsV2 (`GET /bucket?list-type=2`, pages of `max-keys`, continuation tokens), HEAD and GET with Range
and `If-Match` (412 when the ETag differs), PUT of objects (the body's signed SHA-256 checked) and buckets, DELETE,
errors as S3's XML (`NoSuchKey`, `NoSuchBucket`, `SlowDown` with `Retry-After`, `InternalError`), an MD5 ETag; with
`keys={access key id: secret}` it checks every request's AWS Signature V4 with botocore's own signer (403
`InvalidAccessKeyId`, `SignatureDoesNotMatch`, `AccessDenied` unsigned)."""
import email.utils, fnmatch, hashlib, http.server, os, socket, threading, time, urllib.parse
from pathlib import Path
from xml.sax.saxutils import escape


class FaultServer:
    "Serves `root` on 127.0.0.1 (a free port), playing the faults of its rules; `log` has every request."
    def __init__(self, root, etag: bool = True, s3: bool = False, keys: dict | None = None):
        self.root, self.etag, self.rules, self.log, self.gets = Path(root), etag, [], [], {}
        self.s3, self.keys, self.listings = s3, keys, {}
        self.lock, self.quit = threading.Lock(), threading.Event()
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), (_s3_handler if s3 else _handler)(self))
        self.httpd.daemon_threads = True
        self.httpd.handle_error = lambda request, address: None  # a client that went away (it timed out) is no error
        threading.Thread(target=self.httpd.serve_forever, kwargs=dict(poll_interval=0.05), daemon=True).start()
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def url(self, name: str) -> str: return f"{self.base}/{name}"
    def requests(self, method: str | None = None, listing: bool | None = None) -> list[tuple]:
        "The requests logged (method, path, Range or query, fault, time), of `method` and (S3) listings or not."
        return [r for r in self.log if (method is None or r[0] == method)
                and (listing is None or (r[2] is not None and str(r[2]).startswith("list-type")) == listing)]
    def urls(self, names) -> list[str]: return [self.url(n) for n in names]

    def fault(self, kind, pattern: str = "*", when: str = "first", *, times: int | None = None, retry_after: float = 1,
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


N_SHARDS, PER_SHARD = 8, 40  # the fault tests' shards (write_fault_shards)
NAMES = [f"f-{s:03d}.tar" for s in range(N_SHARDS)]


def write_fault_shards(d: Path) -> Path:
    "8 shards of 40 samples in `d` (a class and 3 KB of bytes each): small, but a cut lands inside a member."
    import numpy as np
    import webdataset as wds
    rng = np.random.default_rng(0)
    for s, name in enumerate(NAMES):
        with wds.TarWriter(str(d / name)) as w:
            for i in range(PER_SHARD):
                w.write({"__key__": f"s{s}_{i:02d}", "cls": (s * PER_SHARD + i) % 7,
                         "bin": rng.integers(0, 256, 3000, dtype=np.uint8).tobytes()})
    return d


def fast_retries(**kw):
    "Retries with short pauses and a 1 s read timeout (a stall is seen in 1 s): the tests' setting."
    from shardkit.remote import Retries
    return Retries(**{"backoff": 0.02, "max_backoff": 0.2, "read_timeout": 1.0, "wait": 20, **kw})


def _send_object(h, server: FaultServer, f: Path, data: bytes, *, tag: str | None, rng: str | None, rule: dict | None,
                 body: bool):
    """Answer a GET (`body`) or HEAD of the file `f` holding `data`: whole, or the byte range `rng` ("bytes=A-B",
    "bytes=A-"), with its ETag `tag` (if any); a "cut", "stall" or "rewrite" `rule` sends half of it, then drops."""
    a, b = 0, len(data) - 1
    if rng:
        lo, hi = rng.removeprefix("bytes=").split("-")
        a, b = int(lo), min(int(hi), len(data) - 1) if hi else len(data) - 1
    h.send_response(206 if rng else 200)
    h.send_header("Content-Length", str(b + 1 - a)); h.send_header("Accept-Ranges", "bytes")
    if tag: h.send_header("ETag", tag)
    h.send_header("Last-Modified", email.utils.formatdate(os.stat(f).st_mtime, usegmt=True))
    if rng: h.send_header("Content-Range", f"bytes {a}-{b}/{len(data)}")
    h.end_headers()
    if not body: return
    kind = rule["kind"] if rule else None
    if kind in ("cut", "stall", "rewrite"):
        try:
            h.wfile.write(data[a:a + (b + 1 - a) // 2]); h.wfile.flush()
            if kind == "stall": server.quit.wait(rule["stall"])
        except OSError: pass
        if kind == "rewrite": f.write_bytes(data[::-1])
        return h._drop()
    try: h.wfile.write(data[a:b + 1])
    except OSError: pass  # the client went away (it timed out, or stopped reading)


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
            partial = bool(rng) and (not server.etag or self.headers.get("If-Range", tag) == tag)
            # a changed object (If-Range no longer matches) comes whole, as HTTP says
            _send_object(self, server, f, data, tag=tag if server.etag else None, rng=rng if partial else None,
                         rule=rule, body=body)
    return Handler


_S3_FAULT_CODES = {500: "InternalError", 503: "SlowDown", 429: "SlowDown", 502: "BadGateway", 504: "GatewayTimeout",
                   408: "RequestTimeout", 403: "AccessDenied", 404: "NoSuchKey"}


def _signature_problem(server: FaultServer, h, method: str, url: str, body: bytes = b"") -> str | None:
    "None if the request's SigV4 signature is botocore's for it, else the S3 error code (shardkit's signer, checked)."
    import datetime, logging
    logging.getLogger("botocore.auth").disabled = True  # the server's check logs what it signs, session token included
    from unittest import mock
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials
    auth = h.headers.get("Authorization", "")
    if not auth.startswith("AWS4-HMAC-SHA256 "): return "AccessDenied"
    fields = dict(p.strip().split("=", 1) for p in auth[len("AWS4-HMAC-SHA256 "):].split(","))
    key_id, day, region = fields["Credential"].split("/")[:3]
    if key_id not in server.keys: return "InvalidAccessKeyId"
    signed = fields["SignedHeaders"].split(";")
    req = AWSRequest(method, url, headers={k: h.headers[k] for k in signed if k != "host"}, data=body)
    when = datetime.datetime.strptime(h.headers["x-amz-date"], "%Y%m%dT%H%M%SZ")
    with mock.patch("botocore.auth.get_current_datetime", lambda: when):
        S3SigV4Auth(Credentials(key_id, server.keys[key_id], h.headers.get("x-amz-security-token")), "s3",
                    region).add_auth(req)
    return None if req.headers["Authorization"] == auth else "SignatureDoesNotMatch"


def _s3_handler(server: FaultServer):
    class S3Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True
        def log_message(self, *args): pass
        def do_HEAD(self): self._serve(body=False)
        def do_GET(self): self._serve(body=True)
        def do_PUT(self): self._put()
        def do_DELETE(self): self._delete()

        def _error(self, status: int, code: str, retry_after=None, body: bool = True):
            data = (f"<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{code}</Code><Message>{code} (the fault "
                    f"server)</Message><RequestId>0</RequestId></Error>").encode() if body else b""
            self.send_response(status)
            if retry_after is not None and status in (429, 503): self.send_header("Retry-After", f"{retry_after:g}")
            self.send_header("Content-Type", "application/xml"); self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body and self.command != "HEAD": self.wfile.write(data)

        def _drop(self):
            self.close_connection = True
            try: self.connection.shutdown(socket.SHUT_RDWR)
            except OSError: pass

        def _where(self):
            "(bucket, key, query, the bucket's folder, the object's file) of this request; a bucket outside root: None."
            u = urllib.parse.urlsplit(self.path)
            bucket, _, key = urllib.parse.unquote(u.path).lstrip("/").partition("/")
            folder = (server.root / bucket).resolve()
            if server.root.resolve() not in folder.parents: return None
            f = (folder / key).resolve() if key else None
            if f is not None and folder not in f.parents: return None
            return bucket, key, dict(urllib.parse.parse_qsl(u.query, keep_blank_values=True)), folder, f

        def _refused(self, body: bytes = b"") -> bool:
            if not server.keys: return False
            url = f"http://{self.headers['Host']}{self.path}"
            try: why = _signature_problem(server, self, self.command, url, body=body)
            except (KeyError, ValueError): why = "AccessDenied"
            if why: self._error(403, why, body=self.command != "HEAD")
            return bool(why)

        def _serve(self, body: bool):
            w = self._where()
            if w is None: return self._error(400, "InvalidURI")
            bucket, key, query, folder, f = w
            rng = self.headers.get("Range")
            listing = not key and body and query.get("list-type") == "2"
            rule = server._pick(self.path.split("?", 1)[0], bool(rng)) if body else None
            kind = rule["kind"] if rule else None
            server.log.append((self.command, self.path.split("?", 1)[0],
                               urllib.parse.urlsplit(self.path).query if listing else rng, kind, time.monotonic()))
            if self._refused(): return
            if isinstance(kind, int): return self._error(kind, _S3_FAULT_CODES.get(kind, "Fault"), rule["retry_after"])
            if kind == "reset": return self._drop()
            if not folder.is_dir(): return self._error(404, "NoSuchBucket", body=body)
            if not key:
                if listing: return self._list(bucket, folder, query)
                self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers(); return
            if not f.is_file(): return self._error(404, "NoSuchKey", body=body)
            data = f.read_bytes()
            tag = f'"{hashlib.md5(data).hexdigest()}"'
            if (want := self.headers.get("If-Match")) and want != tag: return self._error(412, "PreconditionFailed")
            _send_object(self, server, f, data, tag=tag, rng=rng, rule=rule, body=body)

        def _list(self, bucket: str, folder: Path, q: dict):
            prefix, most = q.get("prefix", ""), min(int(q.get("max-keys", 1000)), 1000)
            after = q.get("continuation-token") or q.get("start-after", "")
            if not q.get("continuation-token") or (folder, prefix) not in server.listings:  # a listing's snapshot
                server.listings[folder, prefix] = sorted(
                    os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs
                    if os.path.relpath(os.path.join(d, f), folder).startswith(prefix))
            keys = [k for k in server.listings[folder, prefix] if k > after]
            page, more = keys[:most], len(keys) > most
            items = "".join(f"<Contents><Key>{escape(k)}</Key><Size>{(folder / k).stat().st_size}</Size>"
                            f"<ETag>&quot;{hashlib.md5((folder / k).read_bytes()).hexdigest()}&quot;</ETag></Contents>"
                            for k in page)
            token = f"<NextContinuationToken>{escape(page[-1])}</NextContinuationToken>" if more else ""
            data = (f"<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<ListBucketResult xmlns=\"http://s3.amazonaws.com/doc/"
                    f"2006-03-01/\"><Name>{bucket}</Name><Prefix>{escape(prefix)}</Prefix><KeyCount>{len(page)}"
                    f"</KeyCount><MaxKeys>{most}</MaxKeys><IsTruncated>{str(more).lower()}</IsTruncated>{items}{token}"
                    "</ListBucketResult>").encode()
            self.send_response(200); self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(data))); self.end_headers(); self.wfile.write(data)

        def _put(self):
            data = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            w = self._where()
            if w is None: return self._error(400, "InvalidURI")
            bucket, key, _, folder, f = w
            rule = server._pick(self.path.split("?", 1)[0], False)
            server.log.append(("PUT", self.path.split("?", 1)[0], None, rule and rule["kind"], time.monotonic()))
            if self._refused(data): return
            if rule and isinstance(rule["kind"], int):
                return self._error(rule["kind"], _S3_FAULT_CODES.get(rule["kind"], "Fault"), rule["retry_after"])
            sha = self.headers.get("x-amz-content-sha256", "UNSIGNED-PAYLOAD")
            if sha != "UNSIGNED-PAYLOAD" and sha != hashlib.sha256(data).hexdigest():
                return self._error(400, "XAmzContentSHA256Mismatch")
            if not key: folder.mkdir(exist_ok=True)
            elif not folder.is_dir(): return self._error(404, "NoSuchBucket")
            else:
                f.parent.mkdir(parents=True, exist_ok=True)
                tmp = f.with_name(f".{f.name}.{threading.get_ident()}.part"); tmp.write_bytes(data); os.replace(tmp, f)
            self.send_response(200)
            if key: self.send_header("ETag", f'"{hashlib.md5(data).hexdigest()}"')
            self.send_header("Content-Length", "0"); self.end_headers()

        def _delete(self):
            w = self._where()
            if w is None: return self._error(400, "InvalidURI")
            server.log.append(("DELETE", self.path.split("?", 1)[0], None, None, time.monotonic()))
            if self._refused(): return
            if w[4] is not None: w[4].unlink(missing_ok=True)
            self.send_response(204); self.send_header("Content-Length", "0"); self.end_headers()
    return S3Handler
