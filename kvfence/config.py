"""The configuration tree: every option of every kvfence process, its default and its help text, defined once.

One frozen dataclass per section (model, cache, scheduler, engine, kernels, server, pd) under `Config`. The flags
are generated from these fields (kvfence/flags.py), PD workers receive their tree as JSON, every process logs it
at start (`describe`), `GET /debug/config` returns it and each worker carries it in its registration. Secrets
(`admin_key`) never leave the process. Environment variables are documented overrides that feed the tree (a
field's `env`, applied by `from_env`); nothing reads them behind its back. Torch-free.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from kvfence.faults import Faults
from kvfence.model.fetch import DEFAULT_MODEL_PATH
from kvfence.options import (
    DEFAULT_KV_CACHE_GIB,
    DTYPE_BYTES,
    DTYPES,
    ENGINE,
    HTTP,
    INT8_MODES,
    PREFILL,
    ROUTER,
    SERVE,
    SIZED,
    WORKERS,
    check,
    internal,
    is_march,
    option,
    parse_value,
)

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


@dataclass(frozen=True)
class ModelOptions:
    model: str = option(
        str(DEFAULT_MODEL_PATH), "GGUF file or Hugging Face directory", commands=ENGINE | {ROUTER}
    )
    dtype: str = option(
        "auto", "auto: bfloat16 on CUDA and on CPUs with AVX512-BF16 or AMX, else float32", choices=DTYPES
    )
    device: str = option("cpu", "cpu or cuda")
    context_length: int | None = option(None, "lower the model's context length")

    def __post_init__(self) -> None:
        check(self.dtype in DTYPES, f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        check(
            self.context_length is None or self.context_length >= 1,
            f"--context-length must be at least 1, got {self.context_length}",
        )


@dataclass(frozen=True)
class CacheOptions:
    page_size: int = option(16, "tokens per KV page")
    kv_pages: int | None = option(None, "KV pool size in pages", group="pool")
    kv_cache_memory: float | None = option(
        None, f"KV pool size in GiB (default {DEFAULT_KV_CACHE_GIB:g})", group="pool"
    )
    enable_prefix_cache: bool = option(
        True,
        "reuse sealed KV pages of earlier requests of the same tenant (docs/prefix-cache.md; default on)",
        alias_off="--disable-prefix-cache",
    )
    kv_canary_interval: int = option(
        64,
        "re-verify the digests of a few cached pages every STEPS engine steps (0: only on reuse)",
        metavar="STEPS",
    )
    integrity_checks: bool = option(
        True,
        "I1 checks before and after every step, and tag stamping (--no-integrity-checks: benchmarks only)",
    )

    clamp_context_length: bool = option(
        False,
        "if the KV pool cannot hold one full-context request, advertise only what it holds",
        commands=SIZED,
        group="size",
    )
    allow_undersized_pool: bool = option(
        False,
        "test/debug: start even if the pool cannot hold one full-context request",
        commands=SIZED,
        group="size",
    )

    def __post_init__(self) -> None:
        check(
            self.page_size >= 1 and self.page_size & (self.page_size - 1) == 0,
            f"--page-size must be a power of two, got {self.page_size}",
        )
        check(
            self.kv_pages is None or self.kv_pages >= 1, f"--kv-pages must be at least 1, got {self.kv_pages}"
        )
        check(
            self.kv_pages is None or self.kv_cache_memory is None,
            "give either --kv-pages or --kv-cache-memory, not both",
        )
        check(
            self.kv_cache_memory is None or self.kv_cache_memory > 0,
            f"--kv-cache-memory must be positive, got {self.kv_cache_memory}",
        )
        check(
            not (self.clamp_context_length and self.allow_undersized_pool),
            "give either --clamp-context-length or --allow-undersized-pool, not both",
        )
        check(
            self.kv_canary_interval >= 0,
            f"--kv-canary-interval must be 0 (off) or a number of steps, got {self.kv_canary_interval}",
        )

    def num_pages(self, kv_bytes_per_token: int) -> int:
        """The pool's size: `kv_pages`, or what `kv_cache_memory` GiB holds at `kv_bytes_per_token` bytes."""
        if self.kv_pages is not None:
            return self.kv_pages
        gib = self.kv_cache_memory if self.kv_cache_memory is not None else DEFAULT_KV_CACHE_GIB
        page_bytes = self.page_size * kv_bytes_per_token
        num_pages = int(gib * (1 << 30)) // page_bytes
        if num_pages < 1:
            raise ValueError(f"kv_cache_memory {gib} GiB holds no page of {page_bytes} bytes")
        return num_pages


@dataclass(frozen=True)
class SchedulerOptions:
    max_num_seqs: int = option(64, "requests in one step at most")
    max_num_batched_tokens: int = option(2048, "tokens per step at most")
    prefill_batch_tokens: int = option(
        256, "a step with prefill tokens takes another request's prefill only within this many (0: no limit)"
    )
    interrupt_steps: bool = option(
        True,
        "vtc: a step with more prompt tokens than --prefill-batch-tokens stops between layers when a tenant "
        "with no work here sends a request, which then goes first (docs/fairness.md); --no-interrupt-steps: "
        "such a step runs to its end",
    )
    policy: str = option(
        "vtc",
        "order across tenants: vtc (virtual token counters, with the keys file's weights and page shares; "
        "docs/fairness.md) or fcfs (arrival order, no shares)",
        flag="--scheduling-policy",
        choices=("vtc", "fcfs"),
    )

    def __post_init__(self) -> None:
        check(
            self.max_num_seqs >= 1 and self.max_num_batched_tokens >= 1,
            "--max-num-seqs and --max-num-batched-tokens must be at least 1",
        )
        check(self.prefill_batch_tokens >= 0, "--prefill-batch-tokens must be 0 (no limit) or positive")


@dataclass(frozen=True)
class EngineOptions:
    threads: int | None = option(None, "torch threads (default: all cores)")
    decode_threads: int | None = option(
        None, "torch threads for steps without prefill tokens (default: --threads)"
    )
    faults: str = option(
        "",
        "debug/test only: arm fault knobs that reintroduce historical bugs, e.g. drop_write=1 (docs/faults.md)",
        env="KVFENCE_FAULTS",
        metavar="SPEC",
    )
    seed: int = internal(0)
    lease_prefix: int | None = internal(None)  # distinct lease ids for engines that exchange pages

    def __post_init__(self) -> None:
        Faults.parse(self.faults)  # an unknown knob is refused here, not when the engine starts
        for name in ("threads", "decode_threads"):
            value = getattr(self, name)
            check(value is None or value >= 1, f"--{name.replace('_', '-')} must be at least 1, got {value}")


@dataclass(frozen=True)
class KernelOptions:
    """The compute path, chosen once when the model loads (`kvfence.model.kernels.configure`)."""

    kernels: bool = option(True, "the C++ CPU kernels (--no-kernels: plain torch)", env="KVFENCE_KERNELS")
    quant_kernels: bool = option(
        True,
        "linear layers on the GGUF's own Q4_1/Q8_0 blocks (--no-quant-kernels: on bfloat16 weights)",
        env="KVFENCE_QUANT_KERNELS",
    )
    int8: str = option(
        "decode",
        "int8 activations for linear layers on GGUF blocks: in steps of few rows (decode), every step (all) "
        "or none (0)",
        choices=INT8_MODES,
        env="KVFENCE_INT8",
    )
    kernels_march: str = option(
        "native",
        "gcc -march target the kernels are built for (native, or e.g. x86-64-v3 for any recent x86 CPU)",
        env="KVFENCE_KERNELS_MARCH",
    )
    hugepages: bool = option(
        True, "back the KV pool and large buffers with transparent huge pages", env="KVFENCE_HUGEPAGES"
    )
    amx_tiles: bool = option(
        True,
        "AMX tile kernels for bfloat16 linear layers and prefill and decode attention where the CPU has them "
        "(--no-amx-tiles: oneDNN's products, torch's prefill attention, AVX-512 decode attention)",
        env="KVFENCE_AMX_TILES",
    )

    def __post_init__(self) -> None:
        check(self.int8 in INT8_MODES, f"--int8 {self.int8!r}: expected one of {', '.join(INT8_MODES)}")
        check(
            is_march(self.kernels_march),
            f"--kernels-march {self.kernels_march!r}: expected a gcc -march target such as native or x86-64-v3",
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KernelOptions:
        """The options with the environment's overrides (for code that loads a model outside a `Config`)."""
        return _with_env(cls(), os.environ if environ is None else environ)


@dataclass(frozen=True)
class ServerOptions:
    host: str = option("127.0.0.1", "bind address (default: loopback only)", commands=HTTP)
    port: int = option(8000, "HTTP port", commands=HTTP)
    served_model_name: str | None = option(
        None, "model name clients send (default: file stem)", commands=HTTP
    )
    api_keys: str | None = option(None, "TOML or JSON file mapping API key -> tenant name", commands=HTTP)
    max_queue: int = option(256, "waiting requests before answering 503", commands=HTTP)
    max_body_bytes: int = option(4 << 20, "largest request body accepted", commands=HTTP)
    admin_key: str | None = option(
        None,
        "key that opens GET /debug/kv and /debug/config, the page map and `kvfence top` (unset: nobody)",
        commands=HTTP,
        env="KVFENCE_ADMIN_KEY",
        secret=True,
    )
    metrics_key: str | None = option(
        None,
        "key that opens GET /metrics only (a Prometheus scrape credential); the admin key opens it too. With "
        "--api-keys and neither key set, nobody reads /metrics: its series name tenants",
        commands=HTTP,
        env="KVFENCE_METRICS_KEY",
        secret=True,
    )
    ssl_keyfile: str | None = option(
        None, "HTTPS: the server's private key (PEM); needs --ssl-certfile", commands=HTTP, metavar="PATH"
    )
    ssl_certfile: str | None = option(
        None,
        "HTTPS: the server's certificate chain (PEM); needs --ssl-keyfile",
        commands=HTTP,
        metavar="PATH",
    )

    def __post_init__(self) -> None:
        check(self.max_queue >= 1, f"--max-queue must be at least 1, got {self.max_queue}")
        check(self.max_body_bytes >= 1, f"--max-body-bytes must be at least 1, got {self.max_body_bytes}")
        check(0 <= self.port < 65536, f"--port must be 0-65535, got {self.port}")
        check(
            (self.ssl_keyfile is None) == (self.ssl_certfile is None),
            "--ssl-keyfile and --ssl-certfile go together: give both or neither",
        )
        check(
            self.metrics_key is None or self.metrics_key != self.admin_key,
            "--metrics-key must differ from --admin-key",
        )


@dataclass(frozen=True)
class PDOptions:
    mode: str = option(
        "colocated",
        "pd: a router here plus one prefill and one decode worker process on this machine",
        commands=frozenset({SERVE}),
        choices=("colocated", "pd"),
    )
    prefill_kv_pages: int | None = option(
        None, "PD: the prefill worker's pool (pages)", commands=frozenset({SERVE})
    )
    decode_kv_pages: int | None = option(
        None, "PD: the decode worker's pool (pages)", commands=frozenset({SERVE})
    )
    share_cores: bool = option(
        True,
        "PD: a worker steps on all --threads while the other has nothing to step, on half while it has "
        "(kvfence/pd/cores.py); --no-share-cores: always half",
        commands=frozenset({SERVE}),
    )
    transfer_window: int = option(
        8, "PD: page frames in flight per transfer", commands=frozenset({SERVE, PREFILL})
    )
    transfer_timeout: float = option(
        30.0,
        "PD: seconds without progress (a frame, an ack) before a KV transfer is given up",
        commands=WORKERS | {SERVE},
    )
    prefill_timeout: float = option(
        300.0,
        "PD: seconds a reserved transfer may wait for its prefill to finish (long prompts, busy workers)",
        commands=WORKERS | {SERVE},
    )
    bind: str = option(
        "tcp://127.0.0.1:7000",
        "control address workers connect to (default: loopback; another host needs an address it can reach, "
        "and cluster keys)",
        commands=frozenset({ROUTER}),
    )
    cluster_keys: str | None = option(
        None,
        "directory of cluster keys (`kvfence keys init DIR`): CURVE on the control and data planes, only "
        "listed keys join (docs/security.md); required unless --insecure-cluster",
        commands=WORKERS | {ROUTER},
        metavar="DIR",
    )
    cluster_key: str | None = option(
        None,
        "this worker's key in DIR/<role>/ (NAME.key_secret; default: the only one there)",
        commands=WORKERS,
        metavar="NAME",
    )
    insecure_cluster: bool = option(
        False,
        "run the cluster without keys: anyone who reaches its ports can join, read prompts and KV pages and "
        "answer clients (a debugging aid on one trusted host; serve --mode pd: plain sockets)",
        commands=WORKERS | {ROUTER, SERVE},
    )
    num_prefill: int = option(1, "prefill workers to wait for before serving", commands=frozenset({ROUTER}))
    num_decode: int = option(1, "decode workers to wait for before serving", commands=frozenset({ROUTER}))
    router: str | None = option(
        None, "the router's control address, e.g. tcp://10.0.0.1:7000 (required)", commands=WORKERS
    )
    data: str = option(
        "tcp://127.0.0.1:0", "address to bind the KV data socket", commands=frozenset({PREFILL})
    )
    cores_file: str | None = option(
        None,
        "a file shared with the other worker on this host (kvfence/pd/cores.py; made if missing): step on "
        "--max-threads while it has nothing to step, on --threads while it has (--decode-threads unused)",
        commands=WORKERS,
        flag="--share-cores",
        metavar="PATH",
    )
    max_threads: int | None = option(None, "threads when alone (with --share-cores)", commands=WORKERS)
    registration_timeout: float = option(
        300.0,
        "seconds to wait for the workers to register before giving up",
        commands=frozenset({SERVE, ROUTER}),
    )
    prefill_workers: int = option(
        1, "PD: prefill worker processes (or Ray actors) to start", commands=frozenset({SERVE})
    )
    decode_workers: int = option(
        1, "PD: decode worker processes (or Ray actors) to start", commands=frozenset({SERVE})
    )
    placement: str | None = option(
        None,
        "how the router picks a request's prefill and decode worker: load (the default: the least loaded pool "
        "that holds it, a tenant kept on its prefill worker within a bound) or round-robin (in turn, among "
        "pools that hold it)",
        commands=frozenset({SERVE, ROUTER}),
        choices=("load", "round-robin"),
    )
    max_restarts: int = option(
        5,
        "PD: restarts of one worker within --restart-window before it is given up on (a crash loop); 0: never "
        "restart",
        commands=frozenset({SERVE}),
    )
    restart_window: float | None = option(
        None, "PD: seconds over which --max-restarts counts (default 300)", commands=frozenset({SERVE})
    )
    ray: str | None = option(
        None,
        "PD on a Ray cluster: `auto` (the cluster `ray start` made on this host) or its address; the router "
        "and every worker run as Ray actors placed on nodes with the kvfence_prefill / kvfence_decode "
        "resources (docs/scale-out.md; needs kvfence[ray])",
        commands=frozenset({SERVE}),
        metavar="ADDRESS",
    )

    def __post_init__(self) -> None:
        check(self.transfer_window >= 1, f"--transfer-window must be at least 1, got {self.transfer_window}")
        for name in ("transfer_timeout", "prefill_timeout", "registration_timeout"):
            value = getattr(self, name)
            check(value > 0, f"--{name.replace('_', '-')} must be positive, got {value}")
        for name in ("num_prefill", "num_decode", "prefill_workers", "decode_workers"):
            value = getattr(self, name)
            check(value >= 1, f"--{name.replace('_', '-')} must be at least 1, got {value}")
        for name in ("prefill_kv_pages", "decode_kv_pages", "max_threads"):
            value = getattr(self, name)
            check(value is None or value >= 1, f"--{name.replace('_', '-')} must be at least 1, got {value}")
        check(
            self.max_threads is None or self.cores_file is not None,
            "--max-threads only applies with --share-cores PATH (threads when the other worker has nothing)",
        )
        check(
            not (self.insecure_cluster and self.cluster_keys),
            "--insecure-cluster and --cluster-keys contradict each other: pick one",
        )
        check(self.max_restarts >= 0, f"--max-restarts must be at least 0, got {self.max_restarts}")
        check(
            self.restart_window is None or self.restart_window > 0,
            f"--restart-window must be positive, got {self.restart_window}",
        )
        if (
            self.ray is not None
        ):  # Ray workers always get keys (made by the router actor); Ray counts restarts
            check(not self.insecure_cluster, "--ray always uses cluster keys: drop --insecure-cluster")
            check(
                self.restart_window is None,
                "--restart-window is for workers on this host; Ray counts --max-restarts over an actor's life",
            )

    def cluster_flags_given(self) -> list[str]:
        """The cluster's flags set away from their defaults: a colocated `serve` refuses them (they would do
        nothing there). Checked by `serve` itself: the router and the workers take some of them, in no mode."""
        default = PDOptions()
        given = {
            "--prefill-kv-pages": self.prefill_kv_pages is not None,
            "--decode-kv-pages": self.decode_kv_pages is not None,
            "--prefill-workers": self.prefill_workers != default.prefill_workers,
            "--decode-workers": self.decode_workers != default.decode_workers,
            "--ray": self.ray is not None,
            "--max-restarts": self.max_restarts != default.max_restarts,
            "--restart-window": self.restart_window is not None,
            "--placement": self.placement is not None,
            "--no-share-cores": not self.share_cores,
            "--transfer-window": self.transfer_window != default.transfer_window,
            "--transfer-timeout": self.transfer_timeout != default.transfer_timeout,
            "--prefill-timeout": self.prefill_timeout != default.prefill_timeout,
            "--insecure-cluster": self.insecure_cluster,
            "--registration-timeout": self.registration_timeout != default.registration_timeout,
        }
        return [flag for flag, set_ in given.items() if set_]


@dataclass(frozen=True)
class Config:
    model: ModelOptions = field(default_factory=ModelOptions)
    cache: CacheOptions = field(default_factory=CacheOptions)
    scheduler: SchedulerOptions = field(default_factory=SchedulerOptions)
    engine: EngineOptions = field(default_factory=EngineOptions)
    kernels: KernelOptions = field(default_factory=KernelOptions)
    server: ServerOptions = field(default_factory=ServerOptions)
    pd: PDOptions = field(default_factory=PDOptions)

    @classmethod
    def of(cls, **values: Any) -> Config:
        """A tree from flat field names (`Config.of(model=path, page_size=4)`): every field name is unique in
        the tree, so each goes to its one section. An unknown name is refused."""
        return _build(cls, _nest(cls, values))

    def replace(self, **values: Any) -> Config:
        """A copy with fields changed by flat name, validated like `of`."""
        nested = _nest(type(self), values)
        sections = {
            name: dataclasses.replace(getattr(self, name), **changes) for name, changes in nested.items()
        }
        return dataclasses.replace(self, **sections)

    def to_dict(self, public: bool = False) -> dict[str, dict[str, Any]]:
        return {
            s.name: {f.name: getattr(getattr(self, s.name), f.name) for f in fields_of(s.type_) if not
                     (public and f.metadata.get("secret"))}
            for s in sections()
        }  # fmt: skip

    def to_json(self) -> str:
        """The tree as JSON, secrets left out (what a PD worker receives)."""
        return json.dumps(self.to_dict(public=True), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Config:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("configuration JSON must be an object of sections")
        return from_dict(data)

    def describe(self) -> str:
        """One line per section for the start-up log (secrets shown as set or unset)."""

        def shown(f: dataclasses.Field[Any], value: Any) -> Any:
            return ("<set>" if value else "<unset>") if f.metadata.get("secret") else value

        return "\n".join(
            f"{name}: " + " ".join(f"{f}={shown(fields[f], v)}" for f, v in values.items())
            for name, values in self.to_dict().items()
            for fields in [{f.name: f for f in fields_of(type(getattr(self, name)))}]
        )

    @property
    def dtype_bytes(self) -> int:
        """Bytes per K/V element; the dtype must be resolved (`resolve`)."""
        return DTYPE_BYTES[self.model.dtype]


@dataclass(frozen=True)
class Section:
    name: str
    type_: type


def sections() -> list[Section]:
    hints = {"model": ModelOptions, "cache": CacheOptions, "scheduler": SchedulerOptions, "engine": EngineOptions,
             "kernels": KernelOptions, "server": ServerOptions, "pd": PDOptions}  # fmt: skip
    return [Section(f.name, hints[f.name]) for f in dataclasses.fields(Config)]


def fields_of(section: type) -> tuple[dataclasses.Field[Any], ...]:
    return dataclasses.fields(section)


def all_fields() -> Iterator[tuple[str, dataclasses.Field[Any]]]:
    """(section name, field) for every leaf of the tree."""
    for s in sections():
        for f in fields_of(s.type_):
            yield s.name, f


def from_dict(data: Mapping[str, Any]) -> Config:
    """A tree from nested sections; unknown sections or fields are refused, missing ones take their default."""
    known = {s.name for s in sections()}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown configuration section(s): {', '.join(unknown)}")
    for name, values in data.items():
        if not isinstance(values, dict):
            raise ValueError(f"configuration section {name!r} must be an object")
    return _build(Config, {k: dict(v) for k, v in data.items()})


def from_env(config: Config, environ: Mapping[str, str] | None = None) -> Config:
    """`config` with every field whose `env` variable is set taking that variable's value."""
    environ = os.environ if environ is None else environ
    return dataclasses.replace(
        config, **{s.name: _with_env(getattr(config, s.name), environ) for s in sections()}
    )


S = TypeVar("S", bound="DataclassInstance")


def _with_env(section: S, environ: Mapping[str, str]) -> S:
    """A bad value is refused naming its variable (`KVFENCE_INT8='x': ...`), never taken as the default."""
    for f in dataclasses.fields(section):
        env = f.metadata.get("env")
        if env and env in environ:
            try:
                section = dataclasses.replace(section, **{f.name: parse_value(f, environ[env])})
            except ValueError as e:
                raise ValueError(f"{env}={environ[env]!r}: {e}") from None
    return section


def _nest(cls: type[Config], values: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    owner = {f.name: s for s, f in all_fields()}
    nested: dict[str, dict[str, Any]] = {}
    for name, value in values.items():
        if name not in owner:
            raise TypeError(f"unknown configuration field {name!r}")
        nested.setdefault(owner[name], {})[name] = value
    return nested


def _build(cls: type[Config], nested: Mapping[str, Mapping[str, Any]]) -> Config:
    built = {}
    for s in sections():
        values = dict(nested.get(s.name, {}))
        names = {f.name for f in fields_of(s.type_)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"unknown field(s) in section {s.name!r}: {', '.join(unknown)}")
        built[s.name] = s.type_(**values)
    return cls(**built)
