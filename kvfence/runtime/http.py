"""The HTTP front both modes share: the OpenAI API over an `Engine` (local `LLMEngine` or the PD router's
`RemoteEngine`), with the admin views (`/debug/kv`, `/debug/config`) fed by the mode that knows their data."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn

from kvfence.config import Config
from kvfence.dashboard.routes import KvSource
from kvfence.engine.preflight import PreflightReport
from kvfence.engine.protocol import Engine
from kvfence.server.metrics import ServerMetrics

if TYPE_CHECKING:
    from kvfence.engine.fairness import TenantShare
    from kvfence.server.serving import ClusterControl

log = logging.getLogger("kvfence.server")


def serve_http(
    engine: Engine,
    config: Config,
    metrics: ServerMetrics,
    *,
    config_view: Callable[[], dict[str, Any]],
    preflight: PreflightReport | None = None,
    kv_source: KvSource | None = None,
    cluster: ClusterControl | None = None,
    listeners: list[socket.socket],
) -> int:
    """Serve on `listeners` (from `open_front_door`) until interrupted. `config_view`: what `GET /debug/config`
    returns (admin key only)."""
    from kvfence.server.app import build_app
    from kvfence.server.async_engine import AsyncEngine
    from kvfence.server.auth import check_distinct
    from kvfence.server.serving import ServerSettings
    from kvfence.server.tenants import load_keys_file

    server = config.server
    keys_file = load_keys_file(server.api_keys) if server.api_keys else None
    keys = keys_file.keys if keys_file else None
    check_distinct(keys, server.admin_key, server.metrics_key)
    tls = check_tls(server.ssl_keyfile, server.ssl_certfile)
    if keys is not None and not server.admin_key and not server.metrics_key:
        log.warning("/metrics is closed to everyone: its series name tenants, so no tenant's key opens it; to "
                    "scrape it, start with --metrics-key KEY (or KVFENCE_METRICS_KEY) and give Prometheus that "
                    "key (docs/security.md)")  # fmt: skip
    if keys is not None and not tls and not is_loopback(server.host):
        log.warning("serving on %s without HTTPS: API keys cross the network in the clear "
                    "(--ssl-keyfile/--ssl-certfile)", server.host)  # fmt: skip
    if keys is None and not is_loopback(server.host):
        log.warning("serving on %s without --api-keys: every client is the anonymous tenant", server.host)
    async_engine = AsyncEngine(engine, max_queue=server.max_queue, observer=metrics)
    name = server.served_model_name or Path(config.model.model).stem
    settings = ServerSettings(
        name,
        api_keys=keys,
        tenant_limits=keys_file.limits if keys_file else None,
        max_body_bytes=server.max_body_bytes,
        admin_key=server.admin_key,
        metrics_key=server.metrics_key,
        preflight=preflight,
        config_view=config_view,
        cluster=cluster,
    )
    app = build_app(async_engine, settings, metrics, kv_source=kv_source)
    port = listeners[0].getsockname()[1]  # --port 0: the one the OS gave
    uv_config = uvicorn.Config(app, host=server.host, port=port, log_level="info",
                               ssl_keyfile=server.ssl_keyfile, ssl_certfile=server.ssl_certfile)  # fmt: skip
    print(how_to_call(server.host, port, name, with_key=keys is not None, tls=tls), flush=True)
    # Ctrl+C: uvicorn shuts down, then re-raises the interrupt (uvicorn.run swallows it too)
    with contextlib.suppress(KeyboardInterrupt):
        Front(uv_config).run(sockets=listeners)
    return 0


class FrontDoorClosed(Exception):
    """What stops an HTTP command before anything loads (its message for stderr; exit 2)."""


def open_front_door(config: Config, command: str) -> list[socket.socket]:
    """The checks of `front_door_problem`, then the HTTP port, held before anything else: before minutes of
    loading (a port in use is said at once), and before the PD router and workers bind ports the OS picks (it
    could hand out --port to one of them while uvicorn had not bound it yet: it did, once in a full test run).
    The sockets listen from here on (a socket only bound, with SO_REUSEADDR, lets another such socket bind the
    port too): a client that connects while the model loads waits in the backlog until uvicorn serves."""
    if problem := front_door_problem(config, command):
        raise FrontDoorClosed(problem)
    return hold_port(config.server.host, config.server.port, command)


def hold_port(host: str, port: int, command: str) -> list[socket.socket]:
    """`bind_http`, or FrontDoorClosed saying which port and why (`kvfence COMMAND: cannot serve on ...`)."""
    try:
        return bind_http(host, port)
    except OSError as exc:
        raise FrontDoorClosed(
            f"kvfence {command}: cannot serve on --host {host} --port {port}: {exc.strerror or exc}"
        ) from exc


def bind_http(host: str, port: int, backlog: int = 2048) -> list[socket.socket]:
    """Listening TCP sockets on every address `host` names (`localhost`: 127.0.0.1 and ::1; "": all), as
    asyncio's `create_server` binds uvicorn's own: SO_REUSEADDR (a port left in TIME_WAIT by the last run is
    free again), IPv6 sockets IPv6 only. With port 0, every address gets the port the first one got."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    addresses = list(dict.fromkeys((family, addr) for family, _, _, _, addr in infos))
    sockets: list[socket.socket] = []
    try:
        for family, addr in addresses:
            # proto must say TCP: asyncio sets TCP_NODELAY only on such sockets (kvfence/server/background.py)
            sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if sockets[1:]:  # port 0: the first socket's
                addr = (addr[0], sockets[0].getsockname()[1], *addr[2:])
            sock.bind(addr)
            sock.listen(backlog)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


class Front(uvicorn.Server):
    """uvicorn's server on a socket bound beforehand, saying where it serves once it does (uvicorn says so only for
    the sockets it binds itself)."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and sockets:
            scheme = "https" if self.config.is_ssl else "http"
            host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
            port = sockets[0].getsockname()[1]
            logging.getLogger("uvicorn.error").info(
                "Uvicorn running on %s://%s:%d (Press CTRL+C to quit)", scheme, host, port
            )


def front_door_problem(config: Config, command: str) -> str | None:
    """What stops an HTTP command before anything loads (exit 2): unreadable TLS files, an operator key that is
    also a tenant's, a bad API keys file."""
    from kvfence.server.auth import check_distinct
    from kvfence.server.tenants import load_keys_file

    server = config.server
    try:
        keys_file = load_keys_file(server.api_keys) if server.api_keys else None
        check_distinct(keys_file.keys if keys_file else None, server.admin_key, server.metrics_key)
        check_tls(server.ssl_keyfile, server.ssl_certfile)
    except (OSError, ValueError) as exc:
        return f"kvfence {command}: {exc}"
    return None


def tenant_shares(config: Config) -> dict[str, TenantShare]:
    """The keys file's weights and page shares per tenant (a PD router sends them to its workers); {} without
    one. The file was checked by `front_door_problem` already."""
    from kvfence.server.tenants import load_keys_file

    path = config.server.api_keys
    return load_keys_file(path).shares if path else {}


def check_tls(keyfile: str | None, certfile: str | None) -> bool:
    """Whether to serve HTTPS. Both files must be readable and hold a certificate chain and its private key
    (PEM); else ValueError naming the flag and the path (exit 2 at startup, before anything loads)."""
    import ssl

    if keyfile is None or certfile is None:  # ServerOptions has checked they come together
        return False
    for flag, path in (("--ssl-keyfile", keyfile), ("--ssl-certfile", certfile)):
        try:
            Path(path).read_bytes()
        except OSError as exc:
            raise ValueError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from exc
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile)
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(
            f"--ssl-certfile {certfile} with --ssl-keyfile {keyfile}: not a usable certificate and key ({exc})"
        ) from exc
    return True


def how_to_call(host: str, port: int, model: str, with_key: bool, tls: bool = False) -> str:
    host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    base = f"{'https' if tls else 'http'}://{host}:{port}/v1"
    auth = " -H 'Authorization: Bearer YOUR_KEY'" if with_key else ""
    key = "YOUR_KEY" if with_key else "none"
    body = f'{{"model": "{model}", "messages": [{{"role": "user", "content": "What is a KV cache?"}}]}}'
    return (
        f"\nkvfence serves {model} at {base} (OpenAI API). Try:\n"
        f"  curl {base}/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'\n"
        f'  python -c \'from openai import OpenAI; c = OpenAI(base_url="{base}", api_key="{key}"); '
        f'print(c.chat.completions.create(model="{model}", messages=[{{"role": "user", '
        f'"content": "Hello!"}}]).choices[0].message.content)\'\n'
    )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
