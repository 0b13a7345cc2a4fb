"""A stand-in for the Hugging Face Hub on 127.0.0.1, for tests.

It answers exactly the HTTP calls huggingface_hub 1.33's own client makes for:
  reading   model_info, list_repo_files (tree), get_paths_info, hf_hub_download
            (HEAD + GET with ETag / X-Repo-Commit / X-Linked-Size, Range resume);
            the same reads for dataset repos (repo_type="dataset": /api/datasets/…,
            /datasets/…/resolve/…), seeded with add_repo_from_folder(repo_type="dataset");
  writing   whoami-v2 (Bearer auth), repos/create (409 on collision), create_branch,
            list_repo_commits, validate-yaml, preupload, commit (ndjson), and the
            LFS batch API with basic PUT upload + verify.

It does not speak Xet.  huggingface_hub 1.33 picks Xet for uploads whenever the
`hf_xet` package is importable, without asking the server, so a client talking to
this stand-in must run with HF_HUB_DISABLE_XET=1 (`client_env()` sets it); the
xet-token endpoints answer 501 with a message saying so.  Downloads never see an
X-Xet-Hash header, so they take the plain HTTP path anyway.

Storage: file contents live content-addressed under `root/.objects/<sha256>`; each
branch head is also written out as a plain folder `root/<ns>/<name>/@<branch>/`
so tests can look at what "landed".  Repo state (branches, commits) is in memory.

Test hooks:
  requests                  every request as (method, path) — count what the client sent
  lfs_puts                  sha256 of every LFS object whose PUT body arrived complete
  drop_after_bytes(n)       the next upload or download body is cut after n more bytes
                            (connection closed, no response): one-shot
  hold_lfs_puts_after(n)    after n complete LFS PUTs, further PUTs stall (until
                            release() or hold_timeout s) and are then cut, never stored —
                            lets a test kill the client mid-upload; `held` is set when
                            one is stalled
The server stops by itself after `lifetime` seconds even if a test forgets it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

# Files the stand-in stores as LFS, like the Hub's default .gitattributes does.
_LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".model", ".msgpack", ".h5", ".gz", ".zip", ".npy")
_LFS_MIN_SIZE = 10 * 1024 * 1024
_GITATTRIBUTES = b"".join(f"*{s} filter=lfs diff=lfs merge=lfs -text\n".encode() for s in _LFS_SUFFIXES)
_CHUNK = 1 << 16


def git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


@dataclass(frozen=True)
class Entry:
    """One file in a commit's tree."""

    sha256: str
    size: int
    lfs: bool

    @property
    def git_oid(self) -> str:
        # An LFS file's git oid is the oid of its pointer, as on the Hub.
        if self.lfs:
            return git_blob_oid(_lfs_pointer(self.sha256, self.size))
        return self._regular_oid

    _regular_oid: str = ""


@dataclass
class Commit:
    sha: str
    parent: str | None
    title: str
    date: str
    tree: dict[str, Entry]


@dataclass
class Repo:
    repo_id: str
    private: bool = False
    gated: bool = False
    gated_users: set[str] = field(default_factory=set)
    branches: dict[str, str] = field(default_factory=dict)  # branch -> commit sha
    commits: dict[str, Commit] = field(default_factory=dict)
    lfs_objects: set[str] = field(default_factory=set)  # LFS oids uploaded to this repo


class _Drop(Exception):
    """Raised inside a handler to cut the connection without answering."""


class HubStandin:
    def __init__(
        self,
        root: Path,
        tokens: dict[str, str] | None = None,
        orgs: dict[str, list[str]] | None = None,
        lifetime: float = 300.0,
        hold_timeout: float = 60.0,
    ):
        self.root = Path(root)
        (self.root / ".objects").mkdir(parents=True, exist_ok=True)
        self.tokens = dict(tokens or {})  # token -> user name
        self.orgs = dict(orgs or {})  # user -> orgs they can write to
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str]] = []
        self.lfs_puts: list[str] = []
        self.range_requests: list[tuple[str, str]] = []
        self.lock = threading.RLock()
        self.lifetime = lifetime
        self.hold_timeout = hold_timeout
        self._drop_budget: int | None = None
        self._hold_after: int | None = None
        self.held = threading.Event()
        self._release = threading.Event()
        self._counter = 0
        self._upload_tickets: dict[str, tuple[str, str]] = {}  # ticket -> (repo id, oid)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._timer: threading.Timer | None = None
        self._conns: set[socket.socket] = set()
        self._endpoint: str | None = None

    # ---- lifecycle -------------------------------------------------------------------

    def start(self) -> "HubStandin":
        standin = self

        class Handler(_Handler):
            hub = standin

        self._server = _Server(("127.0.0.1", 0), Handler)
        self._endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self._thread.start()
        # Stop by ourselves: a forgotten server must not outlive the test run.
        self._timer = threading.Timer(self.lifetime, self.stop)
        self._timer.daemon = True
        self._timer.start()
        return self

    def stop(self) -> None:
        self._release.set()
        if self._timer is not None:
            self._timer.cancel()
        if self._server is not None:
            server, self._server = self._server, None
            server.shutdown()
            server.server_close()
        # Keep-alive connections outlive the listening socket: cut them too.
        with self.lock:
            conns, self._conns = list(self._conns), set()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def __enter__(self) -> "HubStandin":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def endpoint(self) -> str:
        # Still answers after stop(): a stopped stand-in's port is a handy "Hub unreachable".
        assert self._endpoint is not None, "stand-in not started"
        return self._endpoint

    def client_env(self, token: str | None = None, home: Path | None = None, **extra: str) -> dict[str, str]:
        """Environment for a subprocess that talks to this stand-in through huggingface_hub."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
        env.update(
            HF_ENDPOINT=self.endpoint,
            HF_HUB_DISABLE_XET="1",  # no Xet here: see module docstring
            HF_HUB_DISABLE_TELEMETRY="1",
            HF_HUB_DISABLE_PROGRESS_BARS="1",
            HF_HOME=str(home or self.root / ".hf-home"),
            NO_PROXY="127.0.0.1",
            no_proxy="127.0.0.1",
        )
        for k in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
            env.pop(k, None)
        # The client imports kq from this checkout even when it is not pip-installed.
        repo_root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (repo_root, env.get("PYTHONPATH")) if p)
        if token is not None:
            env["HF_TOKEN"] = token
        env.update(extra)
        return env

    # ---- test hooks ------------------------------------------------------------------

    def drop_after_bytes(self, n: int) -> None:
        with self.lock:
            self._drop_budget = n

    def hold_lfs_puts_after(self, n: int) -> None:
        with self.lock:
            self._hold_after = n
            self.held.clear()
            self._release.clear()

    def release(self) -> None:
        with self.lock:
            self._hold_after = None
        self._release.set()

    def count(self, method: str | None = None, contains: str = "") -> int:
        with self.lock:
            return sum(1 for m, p in self.requests if (method is None or m == method) and contains in p)

    # ---- repo state ------------------------------------------------------------------

    def _store_bytes(self, data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        obj = self.root / ".objects" / sha
        if not obj.exists():
            tmp = obj.with_name(f"{sha}.{secrets.token_hex(4)}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, obj)
        return sha

    def _entry(self, path: str, sha: str, size: int, data: bytes | None) -> Entry:
        lfs = path.endswith(_LFS_SUFFIXES) or size >= _LFS_MIN_SIZE
        return Entry(sha, size, lfs, "" if lfs or data is None else git_blob_oid(data))

    def _new_commit(self, repo: Repo, branch: str, tree: dict[str, Entry], title: str) -> Commit:
        parent = repo.branches.get(branch)
        self._counter += 1
        listing = json.dumps(sorted((p, e.sha256) for p, e in tree.items()))
        sha = hashlib.sha1(f"{repo.repo_id}\0{parent}\0{title}\0{self._counter}\0{listing}".encode()).hexdigest()
        date = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())
        commit = Commit(sha, parent, title, date, dict(tree))
        repo.lfs_objects.update(e.sha256 for e in tree.values() if e.lfs)
        repo.commits[sha] = commit
        repo.branches[branch] = sha
        self._write_out(repo, branch, commit)
        return commit

    def _write_out(self, repo: Repo, branch: str, commit: Commit) -> None:
        """Materialise the branch head as a plain folder (what a test inspects)."""
        dest = self.repo_dir(repo.repo_id, branch)
        tmp = dest.with_name(dest.name + f".{secrets.token_hex(4)}.tmp")
        for path, entry in commit.tree.items():
            target = tmp / path
            target.parent.mkdir(parents=True, exist_ok=True)
            src = self.root / ".objects" / entry.sha256
            try:
                os.link(src, target)
            except OSError:
                shutil.copyfile(src, target)
        tmp.mkdir(parents=True, exist_ok=True)
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)

    def repo_dir(self, repo_id: str, branch: str = "main") -> Path:
        return self.root / repo_id / f"@{branch.replace('/', '%2F')}"

    @staticmethod
    def _key(repo_id: str, repo_type: str = "model") -> str:
        # Dataset repos live beside model repos under "datasets/<id>" (their URL prefix on the Hub).
        if repo_type not in ("model", "dataset"):
            raise ValueError(f"stand-in serves model and dataset repos, not {repo_type}")
        return repo_id if repo_type == "model" else f"datasets/{repo_id}"

    def create_repo(self, repo_id: str, private: bool = False, gated: bool = False, repo_type: str = "model") -> Repo:
        repo_id = self._key(repo_id, repo_type)
        with self.lock:
            repo = Repo(repo_id, private=private, gated=gated)
            self.repos[repo_id] = repo
            sha = self._store_bytes(_GITATTRIBUTES)
            tree = {".gitattributes": self._entry(".gitattributes", sha, len(_GITATTRIBUTES), _GITATTRIBUTES)}
            self._new_commit(repo, "main", tree, "initial commit")
            return repo

    def add_repo_from_folder(self, repo_id: str, folder: Path, *, private: bool = False, gated: bool = False,
                             repo_type: str = "model") -> str:
        """Seed a repo with the files of a local folder; returns the commit sha."""
        repo = self.create_repo(repo_id, private=private, gated=gated, repo_type=repo_type)
        with self.lock:
            tree = dict(repo.commits[repo.branches["main"]].tree)
            for f in sorted(Path(folder).rglob("*")):
                if f.is_file():
                    data = f.read_bytes()
                    rel = f.relative_to(folder).as_posix()
                    tree[rel] = self._entry(rel, self._store_bytes(data), len(data), data)
            return self._new_commit(repo, "main", tree, "seed").sha

    def head(self, repo_id: str, branch: str = "main") -> Commit:
        with self.lock:
            repo = self.repos[repo_id]
            return repo.commits[repo.branches[branch]]

    def commit_count(self, repo_id: str) -> int:
        with self.lock:
            return len(self.repos[repo_id].commits)


# ---- HTTP ----------------------------------------------------------------------------


class _Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        # A client that was killed or cut mid-request is what the hooks are for: not an error.
        import sys

        if not isinstance(sys.exc_info()[1], (ConnectionError, OSError)):
            super().handle_error(request, client_address)


class _HttpError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


_REPO_API = re.compile(r"^/api/models/([^/]+)/([^/]+)(?:/(.*))?$")
_RESOLVE = re.compile(r"^/([^/]+)/([^/]+)/resolve/([^/]+)/(.+)$")
_DATASET_API = re.compile(r"^/api/datasets/([^/]+)/([^/]+)(?:/(.*))?$")
_DATASET_RESOLVE = re.compile(r"^/datasets/([^/]+)/([^/]+)/resolve/([^/]+)/(.+)$")
_LFS_BATCH = re.compile(r"^/([^/]+)/([^/]+)\.git/info/lfs/objects/batch$")


class _Handler(BaseHTTPRequestHandler):
    hub: HubStandin
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # keep test output clean
        pass

    def setup(self) -> None:
        super().setup()
        with self.hub.lock:
            self.hub._conns.add(self.connection)

    def finish(self) -> None:
        with self.hub.lock:
            self.hub._conns.discard(self.connection)
        super().finish()

    # Every method goes through one dispatcher; errors become Hub-style responses.
    def do_GET(self):
        self._dispatch("GET")

    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_POST(self):
        self._dispatch("POST")

    def do_PUT(self):
        self._dispatch("PUT")

    def _dispatch(self, method: str) -> None:
        self._prefix = ""  # "datasets/" while answering a dataset repo's route
        split = urlsplit(self.path)
        path, self.query = split.path, parse_qs(split.query)
        with self.hub.lock:
            self.hub.requests.append((method, path))
            if self.headers.get("Range"):
                self.hub.range_requests.append((path, self.headers["Range"]))
        try:
            self._route(method, path)
        except _HttpError as e:
            self._drain()
            headers = {"X-Error-Message": e.message}
            if e.code:
                headers["X-Error-Code"] = e.code
            self._json({"error": e.message}, e.status, headers, head=method == "HEAD")
        except (_Drop, ConnectionError, BrokenPipeError):
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # ---- plumbing --------------------------------------------------------------------

    def _json(self, obj, status: int = 200, headers: dict | None = None, head: bool = False) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _body_chunks(self):
        """Yield the request body (Content-Length or chunked), honouring the drop hook."""
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return
                data = self.rfile.read(size)
                self.rfile.readline()
                yield from self._metered(data)
        else:
            left = int(self.headers.get("Content-Length") or 0)
            while left > 0:
                data = self.rfile.read(min(_CHUNK, left))
                if not data:
                    raise _Drop()
                left -= len(data)
                yield from self._metered(data)

    def _metered(self, data: bytes):
        hub = self.hub
        with hub.lock:
            budget = hub._drop_budget
            if budget is not None:
                if len(data) > budget:
                    hub._drop_budget = None
                    cut = True
                else:
                    hub._drop_budget = budget - len(data)
                    cut = False
        if budget is not None and cut:
            yield data[:budget]
            raise _Drop()
        yield data

    def _body(self) -> bytes:
        return b"".join(self._body_chunks())

    def _drain(self) -> None:
        # Read an unread request body so the keep-alive connection stays in sync.
        if getattr(self, "_body_read", False):
            return
        self._body_read = True
        try:
            if self.headers.get("Content-Length") or self.headers.get("Transfer-Encoding"):
                for _ in self._body_chunks():
                    pass
        except _Drop:
            raise
        except Exception:
            self.close_connection = True

    def _read_body(self) -> bytes:
        self._body_read = True
        return self._body()

    def _user(self) -> str | None:
        """The user behind the Bearer token; 401 for a token the Hub would reject."""
        auth = self.headers.get("Authorization", "")
        if not auth:
            return None
        token = auth.split(" ", 1)[1].strip() if " " in auth else ""
        user = self.hub.tokens.get(token)
        if user is None:
            # The Hub's exact message: huggingface_hub treats it as "bad token", not "repo not found".
            raise _HttpError(401, "Invalid credentials in Authorization header")
        return user

    def _can_write(self, user: str | None, namespace: str) -> bool:
        return user is not None and (namespace == user or namespace in self.hub.orgs.get(user, []))

    def _repo(self, ns: str, name: str, user: str | None) -> Repo:
        repo = self.hub.repos.get(f"{self._prefix}{ns}/{name}")
        if repo is None or (repo.private and not self._can_write(user, ns)):
            raise _HttpError(404 if user else 401, "Repository not found", "RepoNotFound")
        return repo

    def _commit(self, repo: Repo, rev: str) -> Commit:
        sha = repo.branches.get(rev) or (rev if rev in repo.commits else None)
        if sha is None:
            raise _HttpError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        return repo.commits[sha]

    def _require_write(self, user: str | None, ns: str) -> None:
        if user is None:
            raise _HttpError(401, "You must be authenticated to do this")
        if not self._can_write(user, ns):
            raise _HttpError(403, f"You don't have the rights to write in the namespace {ns}")

    # ---- routes ----------------------------------------------------------------------

    def _route(self, method: str, path: str) -> None:
        user = self._user()
        if path == "/api/whoami-v2" and method == "GET":
            if user is None:
                raise _HttpError(401, "Invalid credentials in Authorization header")
            orgs = [{"name": o, "type": "org"} for o in self.hub.orgs.get(user, [])]
            return self._json(
                {"type": "user", "name": user, "fullname": user, "orgs": orgs,
                 "auth": {"type": "access_token", "accessToken": {"displayName": "test", "role": "write"}}}
            )
        if path == "/api/repos/create" and method == "POST":
            return self._create_repo(user)
        if path == "/api/validate-yaml" and method == "POST":
            self._read_body()
            return self._json({"errors": [], "warnings": []})
        if path.startswith("/lfs-upload/") and method == "PUT":
            return self._lfs_put(path.rsplit("/", 1)[1])
        if path.startswith("/lfs-verify/") and method == "POST":
            return self._lfs_verify(path.rsplit("/", 1)[1])
        if m := _LFS_BATCH.match(path):
            return self._lfs_batch(unquote(m[1]), unquote(m[2]), user)
        if m := _REPO_API.match(path):
            return self._repo_api(method, unquote(m[1]), unquote(m[2]), m[3] or "", user)
        if (m := _DATASET_API.match(path)) and method in ("GET", "POST"):
            head = (m[3] or "").split("/")[0]
            if head not in ("", "revision", "tree", "paths-info", "refs", "commits"):
                raise _HttpError(404, f"stand-in: dataset repos are read-only here ({method} {path})")
            self._prefix = "datasets/"
            return self._repo_api(method, unquote(m[1]), unquote(m[2]), m[3] or "", user)
        if (m := _DATASET_RESOLVE.match(path)) and method in ("GET", "HEAD"):
            self._prefix = "datasets/"
            return self._resolve(method, unquote(m[1]), unquote(m[2]), unquote(m[3]), unquote(m[4]), user)
        if (m := _RESOLVE.match(path)) and method in ("GET", "HEAD"):
            return self._resolve(method, unquote(m[1]), unquote(m[2]), unquote(m[3]), unquote(m[4]), user)
        raise _HttpError(404, f"stand-in: no route for {method} {path}")

    def _create_repo(self, user: str | None) -> None:
        body = json.loads(self._read_body() or b"{}")
        ns = body.get("organization") or user
        name = body.get("name")
        if body.get("type", "model") != "model" or not name:
            raise _HttpError(400, "stand-in serves model repos only")
        self._require_write(user, ns)
        repo_id = f"{ns}/{name}"
        url = f"{self.hub.endpoint}/{repo_id}"
        with self.hub.lock:
            if repo_id in self.hub.repos:
                # Like the Hub, a 409 carries the url: huggingface_hub's exist_ok=True path reads it.
                msg = "You already created this model repo"
                return self._json({"error": msg, "url": url}, 409, {"X-Error-Message": msg})
            # huggingface_hub 1.x sends "visibility"; older clients sent "private".
            private = body.get("visibility") == "private" or bool(body.get("private"))
            self.hub.create_repo(repo_id, private=private)
        self._json({"url": url, "name": repo_id, "id": repo_id})

    def _repo_api(self, method: str, ns: str, name: str, rest: str, user: str | None) -> None:
        parts = [unquote(p) for p in rest.split("/")] if rest else []
        if parts[:1] in (["xet-write-token"], ["xet-read-token"]):
            raise _HttpError(501, "stand-in has no Xet storage: run the client with HF_HUB_DISABLE_XET=1")
        with self.hub.lock:
            repo = self._repo(ns, name, user)
        head = parts[0] if parts else ""
        if method == "GET" and (not parts or head == "revision"):
            return self._model_info(repo, parts[1] if len(parts) > 1 else "main")
        if method == "GET" and head == "tree":
            return self._tree(repo, parts[1], "/".join(parts[2:]))
        if method == "GET" and head == "commits":
            return self._commits(repo, parts[1] if len(parts) > 1 else "main")
        if method == "GET" and head == "refs":
            branches = [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": s} for b, s in repo.branches.items()]
            return self._json({"branches": branches, "tags": [], "converts": []})
        if method == "POST" and head == "paths-info":
            return self._paths_info(repo, parts[1])
        if method == "POST" and head == "preupload":
            self._require_write(user, ns)
            return self._preupload(repo, parts[1])
        if method == "POST" and head == "commit":
            self._require_write(user, ns)
            return self._commit_post(repo, parts[1])
        if method == "POST" and head == "branch":
            self._require_write(user, ns)
            return self._create_branch(repo, "/".join(parts[1:]))
        raise _HttpError(404, f"stand-in: no route for {method} /api/models/{ns}/{name}/{rest}")

    # reading

    def _model_info(self, repo: Repo, rev: str) -> None:
        commit = self._commit(repo, rev)
        blobs = self.query.get("blobs", ["false"])[0].lower() in ("1", "true")
        siblings = []
        for p, e in sorted(commit.tree.items()):
            s = {"rfilename": p}
            if blobs:
                s.update(size=e.size, blobId=e.git_oid)
                if e.lfs:
                    s["lfs"] = {"size": e.size, "sha256": e.sha256, "pointerSize": len(_lfs_pointer(e.sha256, e.size))}
            siblings.append(s)
        self._json(
            {"_id": repo.repo_id, "id": repo.repo_id, "modelId": repo.repo_id, "sha": commit.sha,
             "private": repo.private, "gated": "manual" if repo.gated else False, "disabled": False,
             "downloads": 0, "likes": 0, "tags": [], "lastModified": commit.date, "createdAt": commit.date,
             "siblings": siblings}
        )

    def _file_json(self, path: str, e: Entry) -> dict:
        d = {"type": "file", "oid": e.git_oid, "size": e.size, "path": path}
        if e.lfs:
            d["lfs"] = {"oid": e.sha256, "size": e.size, "pointerSize": len(_lfs_pointer(e.sha256, e.size))}
        return d

    def _tree(self, repo: Repo, rev: str, folder: str) -> None:
        commit = self._commit(repo, rev)
        recursive = self.query.get("recursive", ["false"])[0].lower() in ("1", "true")
        prefix = folder.rstrip("/") + "/" if folder else ""
        out, dirs = [], set()
        for p, e in sorted(commit.tree.items()):
            if not p.startswith(prefix):
                continue
            rest = p[len(prefix):]
            segs = rest.split("/")
            for i in range(1, len(segs)):
                if not recursive and i > 1:
                    break
                dirs.add(prefix + "/".join(segs[:i]))
            if recursive or len(segs) == 1:
                out.append(self._file_json(p, e))
        out += [{"type": "directory", "oid": git_blob_oid(d.encode()), "path": d} for d in sorted(dirs)]
        if folder and not out:
            raise _HttpError(404, f"{folder} does not exist", "EntryNotFound")
        self._json(out)

    def _paths_info(self, repo: Repo, rev: str) -> None:
        form = parse_qs(self._read_body().decode())
        commit = self._commit(repo, rev)
        out = []
        for p in form.get("paths", []):
            if p in commit.tree:
                out.append(self._file_json(p, commit.tree[p]))
            elif any(q.startswith(p.rstrip("/") + "/") for q in commit.tree):
                out.append({"type": "directory", "oid": git_blob_oid(p.encode()), "path": p})
        self._json(out)

    def _commits(self, repo: Repo, rev: str) -> None:
        commit, out = self._commit(repo, rev), []
        while commit is not None:
            out.append({"id": commit.sha, "title": commit.title, "message": "", "authors": [], "date": commit.date})
            commit = repo.commits.get(commit.parent) if commit.parent else None
        self._json(out)

    def _resolve(self, method: str, ns: str, name: str, rev: str, filename: str, user: str | None) -> None:
        with self.hub.lock:
            repo = self._repo(ns, name, user)
            commit = self._commit(repo, rev)
            if repo.gated and user not in repo.gated_users and not self._can_write(user, ns):
                raise _HttpError(401 if user is None else 403,
                                 f"Access to model {repo.repo_id} is restricted. You must have access to it.",
                                 "GatedRepo")
            entry = commit.tree.get(filename)
        if entry is None:
            raise _HttpError(404, "Entry not found", "EntryNotFound")
        start, end = 0, entry.size - 1
        rng = self.headers.get("Range")
        if rng:
            m = re.fullmatch(r"bytes=(\d*)-(\d*)", rng.strip())
            if not m or not m[1]:
                raise _HttpError(416, "bad range")
            start = int(m[1])
            end = min(int(m[2]), entry.size - 1) if m[2] else entry.size - 1
            if start >= entry.size:
                raise _HttpError(416, "range not satisfiable")
        length = end - start + 1
        self.send_response(206 if rng else 200)
        etag = entry.sha256 if entry.lfs else entry.git_oid
        self.send_header("ETag", f'"{etag}"')
        self.send_header("X-Repo-Commit", commit.sha)
        if entry.lfs:
            self.send_header("X-Linked-Etag", f'"{entry.sha256}"')
            self.send_header("X-Linked-Size", str(entry.size))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(length))
        if rng:
            self.send_header("Content-Range", f"bytes {start}-{end}/{entry.size}")
        self.send_header("Content-Type", "application/octet-stream")
        self.end_headers()
        if method == "HEAD":
            return
        with open(self.hub.root / ".objects" / entry.sha256, "rb") as f:
            f.seek(start)
            left = length
            while left > 0:
                data = f.read(min(_CHUNK, left))
                left -= len(data)
                for piece in self._metered(data):
                    self.wfile.write(piece)
                    self.wfile.flush()

    # writing

    def _upload_mode(self, path: str, size: int, sample: bytes) -> str:
        if path.endswith(_LFS_SUFFIXES) or size >= _LFS_MIN_SIZE or b"\0" in sample:
            return "lfs"
        return "regular"

    def _preupload(self, repo: Repo, rev: str) -> None:
        body = json.loads(self._read_body())
        with self.hub.lock:
            commit = self._commit(repo, rev)
        files = []
        for f in body.get("files", []):
            mode = self._upload_mode(f["path"], int(f["size"]), base64.b64decode(f.get("sample", "")))
            remote = commit.tree.get(f["path"])
            oid = None
            if remote is not None:
                oid = remote.sha256 if mode == "lfs" and remote.lfs else (remote.git_oid if not remote.lfs else None)
            files.append({"path": f["path"], "uploadMode": mode, "shouldIgnore": False, "oid": oid})
        self._json({"files": files, "commitOid": commit.sha})

    def _commit_post(self, repo: Repo, rev: str) -> None:
        lines = [json.loads(line) for line in self._read_body().splitlines() if line.strip()]
        with self.hub.lock:
            commit = self._commit(repo, rev)
            if rev not in repo.branches:
                raise _HttpError(400, "can only commit to a branch")
            tree = dict(commit.tree)
            title = "commit"
            for item in lines:
                key, value = item["key"], item["value"]
                if key == "header":
                    title = value.get("summary") or title
                    parent = value.get("parentCommit")
                    if parent and parent != commit.sha:
                        raise _HttpError(412, "A commit has happened since. Please refresh and try again.")
                elif key == "file":
                    data = base64.b64decode(value["content"])
                    tree[value["path"]] = self.hub._entry(value["path"], self.hub._store_bytes(data), len(data), data)
                elif key == "lfsFile":
                    obj = self.hub.root / ".objects" / value["oid"]
                    if value["oid"] not in repo.lfs_objects or obj.stat().st_size != int(value["size"]):
                        raise _HttpError(422, f"LFS object {value['oid']} was not uploaded")
                    tree[value["path"]] = Entry(value["oid"], int(value["size"]), True)
                elif key == "deletedFile":
                    tree.pop(value["path"], None)
                elif key == "deletedFolder":
                    prefix = value["path"].rstrip("/") + "/"
                    tree = {p: e for p, e in tree.items() if not p.startswith(prefix)}
                else:
                    raise _HttpError(400, f"stand-in: unsupported commit operation {key}")
            new = self.hub._new_commit(repo, rev, tree, title)
        self._json({"success": True, "commitOid": new.sha,
                    "commitUrl": f"{self.hub.endpoint}/{repo.repo_id}/commit/{new.sha}", "pullRequestUrl": None})

    def _create_branch(self, repo: Repo, branch: str) -> None:
        body = json.loads(self._read_body() or b"{}")
        with self.hub.lock:
            if branch in repo.branches:
                raise _HttpError(409, f"Reference refs/heads/{branch} already exists")
            start = self._commit(repo, body.get("startingPoint") or "main")
            repo.branches[branch] = start.sha
            self.hub._write_out(repo, branch, start)
        self._json({})

    def _lfs_batch(self, ns: str, name: str, user: str | None) -> None:
        body = json.loads(self._read_body())
        with self.hub.lock:
            repo = self._repo(ns, name, user)
        self._require_write(user, ns)
        objects = []
        for obj in body.get("objects", []):
            oid, size = obj["oid"], int(obj["size"])
            with self.hub.lock:
                present = oid in repo.lfs_objects
            if present:
                objects.append({"oid": oid, "size": size})  # no actions: the client skips it
                continue
            ticket = secrets.token_hex(8)
            with self.hub.lock:
                self.hub._upload_tickets[ticket] = (repo.repo_id, oid)
            base = self.hub.endpoint
            objects.append({
                "oid": oid, "size": size, "authenticated": True,
                "actions": {
                    "upload": {"href": f"{base}/lfs-upload/{oid}?ticket={ticket}", "header": {}},
                    "verify": {"href": f"{base}/lfs-verify/{oid}", "header": {}},
                },
            })
        self._json({"transfer": "basic", "objects": objects})

    def _lfs_put(self, oid: str) -> None:
        hub = self.hub
        ticket = self.query.get("ticket", [""])[0]
        with hub.lock:
            repo_id, ticket_oid = hub._upload_tickets.get(ticket, (None, None))
            if ticket_oid != oid:
                raise _HttpError(403, "bad or expired upload ticket")
            hold = hub._hold_after is not None and len(hub.lfs_puts) >= hub._hold_after
        if hold:
            # A test wants the client stuck mid-upload (to kill it): wait, bounded, then cut the
            # connection — this transfer never completes, whatever the socket buffered.
            hub.held.set()
            hub._release.wait(hub.hold_timeout)
            raise _Drop()
        digest = hashlib.sha256()
        tmp = hub.root / ".objects" / f"{oid}.{secrets.token_hex(4)}.part"
        try:
            with open(tmp, "wb") as out:
                self._body_read = True
                for data in self._body_chunks():
                    digest.update(data)
                    out.write(data)
            if digest.hexdigest() != oid:
                raise _HttpError(400, "uploaded content does not match its sha256")
            os.replace(tmp, hub.root / ".objects" / oid)
        finally:
            tmp.unlink(missing_ok=True)
        with hub.lock:
            hub.repos[repo_id].lfs_objects.add(oid)
            hub.lfs_puts.append(oid)
            hub._upload_tickets.pop(ticket, None)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _lfs_verify(self, oid: str) -> None:
        body = json.loads(self._read_body())
        stored = self.hub.root / ".objects" / oid
        if not stored.exists() or stored.stat().st_size != int(body.get("size", -1)):
            raise _HttpError(404, f"LFS object {oid} not found")
        self._json({"success": True})



def run_python(code: str, env: dict[str, str], timeout: float = 120, cwd: Path | None = None):
    """Run `code` in a fresh interpreter (so huggingface_hub reads HF_ENDPOINT & co. at import)."""
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd
    )
