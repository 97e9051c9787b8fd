"""Cluster keys (I10): ZeroMQ CURVE key pairs per role, and the allowlists the router and prefill workers accept.

    DIR/router.key, router.key_secret          the router's pair; every worker needs router.key
    DIR/prefill/NAME.key, NAME.key_secret      one pair per prefill worker (or host)
    DIR/decode/NAME.key, NAME.key_secret       one pair per decode worker (or host)

`kvfence keys init DIR` writes them (secrets mode 0600, directories 0700); `kvfence keys add DIR ROLE NAME` one
more worker's. A role's allowlist is the public keys in its directory: the router's control socket accepts
prefill and decode keys (and a key registers only in its own role), a prefill's data socket accepts decode keys.
Removing a `.key` file revokes it: the router re-reads the directory every second (and on SIGHUP) and drops the
worker; a prefill re-reads it on every new connection. A host needs only its own secret and the public keys
(docs/security.md).

Everything cryptographic is libzmq's (CURVE, with libsodium in pyzmq's wheel) and `zmq.auth`'s (certificate
files, the ZAP authenticator). This module reads files, checks them and wires sockets.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger("kvfence.pd.keys")
ROLES = ("prefill", "decode")
ROUTER = "router"
CONTROL_DOMAIN = "kvfence-control"  # ZAP domain of the router's control socket: prefill and decode keys
LOG_EVERY_S = 60.0  # a refused key is logged at most this often (every refusal is counted)
DATA_DOMAIN = "kvfence-data"  # ZAP domain of a prefill's data socket: decode keys
HANDSHAKE_FAILURES: dict[int, str] = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "auth",  # a key not in the allowlist (ZAP said no)
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol",  # no CURVE, a wrong server key, garbage
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "protocol",  # (libzmq reports a peer without CURVE either way)
}


class KeyFileError(ValueError):
    """A missing, malformed or unsafe key file: the message names the path and the problem (exit 2)."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path


@dataclass(frozen=True, slots=True)
class KeyPair:
    name: str
    public: bytes  # z85, 40 bytes: the principal others see
    secret: bytes | None = None  # z85; None for someone else's key

    @property
    def principal(self) -> str:
        return self.public.decode()


# ---- files ---------------------------------------------------------------------------------------------


def init(directory: Path, prefill: list[str], decode: list[str]) -> list[Path]:
    """Write the router's pair and one pair per named worker; refuses to overwrite an existing router key."""
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    if (directory / "router.key_secret").exists():
        raise KeyFileError(directory / "router.key_secret", "exists already (use `kvfence keys add`)")
    written = [_create(directory, ROUTER)]
    for role, names in (("prefill", prefill), ("decode", decode)):
        written += [add(directory, role, name) for name in names]
    return written


def add(directory: Path, role: str, name: str) -> Path:
    """One more worker's pair, under DIR/ROLE/NAME; its public key joins the role's allowlist at once."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"bad key name {name!r}")
    folder = directory / role
    folder.mkdir(mode=0o700, exist_ok=True)
    if (folder / f"{name}.key").exists() or (folder / f"{name}.key_secret").exists():
        raise KeyFileError(folder / f"{name}.key", "exists already")
    return _create(folder, name)


def _create(folder: Path, name: str) -> Path:
    public, secret = zmq.auth.create_certificates(str(folder), name)
    Path(secret).chmod(0o600)
    Path(public).chmod(0o644)
    return Path(secret)


def load_public(path: Path) -> KeyPair:
    public, _ = _load(path)
    return KeyPair(path.name.removesuffix(".key"), public)


def load_pair(path: Path) -> KeyPair:
    """A secret key file: it must exist, parse, hold a secret, and be readable by its owner only."""
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise KeyFileError(path, f"cannot read the secret key: {exc.strerror}") from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileError(path, f"the secret key is readable by other users (mode {mode & 0o777:o}); "
                           f"run: chmod 600 {path}")  # fmt: skip
    public, secret = _load(path)
    if secret is None:
        raise KeyFileError(path, "holds no secret key")
    return KeyPair(path.name.removesuffix(".key_secret"), public, secret)


def _load(path: Path) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except OSError as exc:
        raise KeyFileError(path, f"cannot read the key: {exc.strerror or exc}") from exc
    except (ValueError, IndexError, UnicodeDecodeError) as exc:
        raise KeyFileError(path, f"not a ZeroMQ CURVE certificate ({exc})") from exc
    for key in (public, secret):
        if key is not None and len(key) != 40:
            raise KeyFileError(path, f"a key must be 40 z85 characters, got {len(key)}")
    if public is None:
        raise KeyFileError(path, "holds no public key")
    return public, secret


def allowlist(directory: Path, roles: tuple[str, ...] = ROLES) -> dict[str, tuple[str, str]]:
    """principal (z85 public key) -> (role, name), from DIR/<role>/*.key. A malformed file raises."""
    allowed: dict[str, tuple[str, str]] = {}
    for role in roles:
        folder = directory / role
        for path in sorted(folder.glob("*.key")) if folder.is_dir() else ():
            key = load_public(path)
            other = allowed.setdefault(key.principal, (role, key.name))
            if other != (role, key.name):
                raise KeyFileError(path, f"the same public key is also {other[0]}/{other[1]}")
    return allowed


# ---- what each process loads -------------------------------------------------------------------------------


@dataclass(frozen=True)
class RouterKeys:
    directory: Path
    own: KeyPair

    @classmethod
    def load(cls, directory: Path) -> RouterKeys:
        _check_dir(directory)
        keys = cls(directory, load_pair(directory / "router.key_secret"))
        keys.allowed()  # a malformed public key fails the start, not the first reload
        return keys

    def allowed(self) -> dict[str, tuple[str, str]]:
        return allowlist(self.directory)


@dataclass(frozen=True)
class WorkerKeys:
    directory: Path
    role: str
    own: KeyPair
    router: KeyPair

    @classmethod
    def load(cls, directory: Path, role: str, name: str | None) -> WorkerKeys:
        """This worker's pair (DIR/ROLE/NAME.key_secret; NAME may be left out when there is one) and the
        router's public key."""
        _check_dir(directory)
        folder = directory / role
        if name is None:
            secrets = sorted(folder.glob("*.key_secret")) if folder.is_dir() else []
            if len(secrets) != 1:
                found = ", ".join(p.name for p in secrets) or "none"
                raise KeyFileError(folder, f"expected exactly one {role} secret key to pick (found {found}); "
                                   "name yours with --cluster-key NAME")  # fmt: skip
            path = secrets[0]
        else:
            path = folder / f"{name}.key_secret"
        keys = cls(directory, role, load_pair(path), load_public(directory / "router.key"))
        if role == "prefill":
            allowlist(directory, ("decode",))  # whom the data socket will accept: checked now
        return keys

    def decode_allowed(self) -> dict[str, tuple[str, str]]:
        return allowlist(self.directory, ("decode",))


def _check_dir(directory: Path) -> None:
    if not directory.is_dir():
        raise KeyFileError(directory, "no such directory (make one with `kvfence keys init DIR`)")


def ephemeral(prefill: int = 1, decode: int = 1) -> Path:
    """A private temporary keys directory for `kvfence serve --mode pd`'s own workers (removed by the caller
    with `shutil.rmtree`)."""
    directory = Path(tempfile.mkdtemp(prefix="kvfence-keys-"))  # mode 0700
    init(directory, [f"prefill-{i}" for i in range(prefill)], [f"decode-{i}" for i in range(decode)])
    return directory


KEY_SUFFIXES = (".key", ".key_secret")


def bundle(directory: Path, role: str, name: str) -> dict[str, bytes]:
    """What one worker needs of a keys directory, as {relative path: bytes}: the router's public key, its own
    pair and (a prefill worker: whom its data socket accepts) every decode public key. For launchers that hand
    keys to a process on another host (Ray actors); `unpack` writes it back out there."""
    wanted = [
        directory / "router.key",
        directory / role / f"{name}.key",
        directory / role / f"{name}.key_secret",
    ]
    if role == "prefill":
        wanted += sorted((directory / "decode").glob("*.key"))
    return {path.relative_to(directory).as_posix(): path.read_bytes() for path in wanted}


def unpack(files: dict[str, bytes]) -> Path:
    """A private temporary keys directory holding `files` (from `bundle`), secrets mode 0600; the caller
    removes it (`remove`)."""
    for relative in files:  # only the names `bundle` makes: router.key, ROLE/NAME.key, ROLE/NAME.key_secret
        parts = Path(relative).parts
        shaped = (len(parts) == 1 and relative == "router.key") or (len(parts) == 2 and parts[0] in ROLES)
        if Path(relative).is_absolute() or ".." in parts or not shaped or not relative.endswith(KEY_SUFFIXES):
            raise KeyFileError(Path(relative), "a key bundle names a path that is not a key of its directory")
    directory = Path(tempfile.mkdtemp(prefix="kvfence-keys-"))  # mode 0700
    for relative, data in files.items():
        path = directory / relative
        path.parent.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
    return directory


def remove(directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)


# ---- sockets -----------------------------------------------------------------------------------------------


class Gate:
    """The ZAP authenticator of one process (one per ZeroMQ context), and what it refused. `allowed(domain)`
    is called on every handshake, on the authenticator's thread, and returns the principals that domain
    accepts: re-read from disk each time where revocation must take effect for the next connection."""

    def __init__(self, ctx: zmq.Context[Any]) -> None:
        self.refused: Counter[str] = Counter()  # handshakes refused, by domain
        self._lock = threading.Lock()
        self._domains: dict[str, Any] = {}
        self._logged: dict[bytes, float] = {}  # refused key -> when it was last logged
        self.auth = ThreadAuthenticator(ctx, log=logging.getLogger("kvfence.pd.zap"))
        self.auth.start()

    def accept(self, domain: str, allowed: Any) -> None:
        """`allowed()` -> the principals `domain` accepts now."""
        self._domains[domain] = allowed
        self.auth.configure_curve_callback(domain, credentials_provider=self)

    def callback(self, domain: str, key: bytes) -> bool:
        try:
            ok = key.decode() in self._domains[domain]()
        except (KeyFileError, OSError) as exc:  # a keys directory broken at run time: nobody new gets in
            log.error("cluster keys: %s; refusing a connection to %s", exc, domain)
            ok = False
        if not ok:
            with self._lock:
                self.refused[domain] += 1
                now, last = time.monotonic(), self._logged.get(key, -LOG_EVERY_S)
                quiet = (
                    now - last < LOG_EVERY_S
                )  # a refused client retries every 100 ms: log it once a minute
                if not quiet:
                    self._logged[key] = now
                    if len(self._logged) > 1024:  # keys seen, bounded
                        self._logged.clear()
            if not quiet:
                log.warning("%s: refused a connection with an unknown key %s (counted in /metrics; logged once a "
                            "minute per key)", domain, key.decode()[:8])  # fmt: skip
        return ok

    def stop(self) -> None:
        self.auth.stop()


def serve_curve(sock: zmq.Socket[Any], own: KeyPair, domain: str) -> None:
    """`sock` (before bind) speaks CURVE as a server and asks ZAP `domain` about every client."""
    assert own.secret is not None
    sock.curve_secretkey = own.secret
    sock.curve_publickey = own.public
    sock.zap_domain = domain.encode()
    sock.curve_server = True


def connect_curve(sock: zmq.Socket[Any], own: KeyPair, server: str) -> None:
    """`sock` (before connect) speaks CURVE as a client of the server whose public key is `server`."""
    assert own.secret is not None
    sock.curve_secretkey = own.secret
    sock.curve_publickey = own.public
    sock.curve_serverkey = server.encode()


class Handshakes:
    """Failed handshakes on one socket (a monitor socket, read by its owner's poll loop), by kind."""

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        events = 0
        for event in HANDSHAKE_FAILURES:
            events |= event
        self.monitor = sock.get_monitor_socket(events)
        self.failed: Counter[str] = Counter()

    def drain(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            self.failed[HANDSHAKE_FAILURES.get(int(event["event"]), "protocol")] += 1

    def close(self) -> None:
        self.monitor.close(0)


def principal_of(frame: zmq.Frame) -> str:
    """The CURVE public key (z85) ZAP authenticated for the connection `frame` came on."""
    return str(frame.get("User-Id"))


def warn_insecure(what: str) -> None:
    log.warning(
        "%s runs WITHOUT cluster keys (--insecure-cluster): anyone who reaches its ports can join, read "
        "prompts and KV pages, and answer clients. Make keys with `kvfence keys init DIR` and pass "
        "--cluster-keys DIR (docs/security.md).",
        what,
    )
    print(f"kvfence {what}: WARNING: --insecure-cluster: no authentication, no encryption", flush=True)


__all__ = [
    "Gate",
    "Handshakes",
    "KeyFileError",
    "KeyPair",
    "RouterKeys",
    "WorkerKeys",
    "add",
    "allowlist",
    "connect_curve",
    "ephemeral",
    "init",
    "load_pair",
    "load_public",
    "principal_of",
    "remove",
    "serve_curve",
    "warn_insecure",
]
