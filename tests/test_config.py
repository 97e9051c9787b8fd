"""The configuration tree (kvfence/config.py) and the flags generated from it (kvfence/flags.py)."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from kvfence import config as tree
from kvfence import options
from kvfence.cli import build_parser
from kvfence.config import Config, KernelOptions, SchedulerOptions
from kvfence.flags import config_from_args, dest, flag_name
from kvfence.runtime.pd import worker_configs
from tests.conftest import make_engine

COMMANDS = ("generate", "serve", "preflight", "router", "prefill", "decode")
REQUIRED = {"generate": ["--prompt", "x"]}


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def other_value(f: dataclasses.Field, current):  # type: ignore[no-untyped-def]
    """A valid value of field `f` other than `current`."""
    choices = f.metadata.get("choices")
    if choices:
        return next(c for c in choices if c != current)
    kind = options.kind(f)
    if kind is bool:
        return not current
    if f.name == "page_size":
        return 32
    if f.name == "faults":
        return "drop_write=1"
    if f.name == "kernels_march":
        return "x86-64-v3"
    if kind is int:
        return (current or 0) + 3
    if kind is float:
        return (current or 0.0) + 1.5
    return f"value-of-{f.name}"


# exclusive with kv_pages, context clamping, cluster_keys and restart_window: each tested on its own
EXCLUSIVE = ("kv_cache_memory", "allow_undersized_pool", "insecure_cluster", "ray")


def every_field_changed() -> Config:
    nested: dict[str, dict[str, object]] = {}
    base = Config()
    for section, f in tree.all_fields():
        if f.name in EXCLUSIVE:
            continue
        nested.setdefault(section, {})[f.name] = other_value(f, getattr(getattr(base, section), f.name))
    return tree.from_dict(nested)


def test_field_names_are_unique_across_the_tree():
    names = [f.name for _, f in tree.all_fields()]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("command", COMMANDS)
def test_a_command_without_flags_runs_with_the_trees_defaults(command, monkeypatch):
    """The parsers hold no default of their own: every flag is SUPPRESS until given, so an unflagged command
    gets `Config()` (each default defined once, in kvfence/config.py)."""
    for _, f in tree.all_fields():
        if f.metadata.get("env"):
            monkeypatch.delenv(f.metadata["env"], raising=False)
    args = parse(command, *REQUIRED.get(command, []))
    assert not [k for k in vars(args) if "." in k], "a flag with a default of its own"
    assert config_from_args(args) == Config()


def test_the_server_the_tests_and_the_benchmarks_schedule_with_the_same_defaults(tiny_model, monkeypatch):
    monkeypatch.delenv("KVFENCE_FAULTS", raising=False)
    served = config_from_args(parse("serve")).scheduler
    assert served == SchedulerOptions() and served.prefill_batch_tokens == 256
    # tests/conftest.py's engines size their batches for tiny models, and take the rest from the tree
    engine = make_engine(tiny_model)
    assert engine.scheduler.config == dataclasses.replace(served, max_num_seqs=32, max_num_batched_tokens=256)
    assert engine.scheduler.config.prefill_batch_tokens == served.prefill_batch_tokens
    # the benchmarks build `Config.of(...)` and get the same scheduler unless they name a field
    assert Config.of(model="x").scheduler == served


def test_every_flag_reaches_its_field():
    for command in COMMANDS:
        parser_args = []
        expected = {}
        for section, f in tree.all_fields():
            if command not in f.metadata.get("commands", ()) or f.name in EXCLUSIVE:
                continue
            value = other_value(f, getattr(getattr(Config(), section), f.name))
            name = flag_name(f)
            if isinstance(value, bool):
                parser_args.append(name if value else f"--no-{name[2:]}")
            else:
                parser_args += [name, str(value)]
            expected[(section, f.name)] = value
        config = config_from_args(parse(command, *REQUIRED.get(command, []), *parser_args))
        for (section, name), value in expected.items():
            assert getattr(getattr(config, section), name) == value, (command, section, name)


def test_json_round_trip_keeps_every_field_and_leaves_secrets_out():
    config = every_field_changed().replace(admin_key="s3cret", metrics_key="scr4pe")
    data = json.loads(config.to_json())
    assert (
        "admin_key" not in data["server"]
        and "s3cret" not in config.to_json()
        and "s3cret" not in config.describe()
    )
    assert Config.from_json(config.to_json()) == config.replace(admin_key=None, metrics_key=None)


def test_a_pd_worker_gets_every_field_through_its_config_file(tmp_path):
    """What `serve --mode pd` hands each worker (JSON on its standard input), read back by the worker's own
    command line: every field of the tree arrives, including fields added later (nothing is listed by hand)."""
    config = every_field_changed().replace(admin_key="s3cret")
    trees = worker_configs(config, "tcp://127.0.0.1:5555", "/dev/shm/cores")
    per_worker = {"router", "threads", "kv_pages", "kv_cache_memory", "cores_file", "max_threads", "admin_key",
                  "api_keys", "cluster_keys", "cluster_key", "metrics_key"}  # fmt: skip
    for role, worker in trees.items():
        path = tmp_path / f"{role}.json"
        path.write_text(worker.to_json())
        got = config_from_args(parse(role, "--config", str(path)))
        assert got == worker.replace(admin_key=None)
        for section, f in tree.all_fields():
            if f.name not in per_worker:
                assert getattr(getattr(got, section), f.name) == getattr(getattr(config, section), f.name), (
                    f.name
                )
        assert got.pd.router == "tcp://127.0.0.1:5555" and got.server.admin_key is None
    assert trees["prefill"].cache.kv_pages == config.pd.prefill_kv_pages


def test_flags_win_over_the_config_file_which_wins_over_the_environment(tmp_path, monkeypatch):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"scheduler": {"max_num_seqs": 7}, "kernels": {"int8": "all"}}))
    monkeypatch.setenv("KVFENCE_INT8", "0")
    monkeypatch.setenv("KVFENCE_KERNELS", "0")
    config = config_from_args(
        parse("generate", "--prompt", "x", "--config", str(path), "--max-num-seqs", "9")
    )
    assert (
        config.scheduler.max_num_seqs == 9
        and config.kernels.int8 == "all"
        and config.kernels.kernels is False
    )
    assert KernelOptions.from_env({"KVFENCE_INT8": "0"}).int8 == "0"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--page-size", "3"], "--page-size must be a power of two"),
        (["--kv-pages", "0"], "--kv-pages must be at least 1"),
        (["--context-length", "0"], "--context-length must be at least 1"),
        (["--kernels-march", "-O0 -fplugin=x"], "--kernels-march"),
        (["--faults", "no_such_knob=1"], "unknown fault knob"),
        (["--max-num-seqs", "0"], "--max-num-seqs"),
    ],
)
def test_bad_values_are_refused_naming_the_flag(argv, message):
    with pytest.raises(ValueError, match=message):
        config_from_args(parse("generate", "--prompt", "x", *argv))


def test_a_workers_max_threads_without_share_cores_is_refused():
    """--max-threads is the thread count when the other worker on the host has nothing to step: without
    --share-cores there is no other worker to watch, so it would do nothing."""
    with pytest.raises(ValueError, match="--max-threads only applies with --share-cores"):
        config_from_args(parse("decode", "--router", "tcp://127.0.0.1:7000", "--max-threads", "2"))
    got = config_from_args(parse("decode", "--router", "tcp://127.0.0.1:7000", "--max-threads", "2",
                                 "--share-cores", "/dev/shm/x"))  # fmt: skip
    assert got.pd.max_threads == 2


def test_bad_config_files_and_environment_values_are_refused(tmp_path, monkeypatch):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"scheduler": {"max_num_sequences": 7}}))
    with pytest.raises(ValueError, match="max_num_sequences"):
        config_from_args(parse("generate", "--prompt", "x", "--config", str(path)))
    path.write_text(json.dumps({"schedular": {}}))
    with pytest.raises(ValueError, match="schedular"):
        config_from_args(parse("generate", "--prompt", "x", "--config", str(path)))
    path.write_text('{"scheduler": {"max_num_seqs": 7, "max_num_seqs": 9}}')  # json would keep the last
    with pytest.raises(ValueError, match="'max_num_seqs' is given twice"):
        config_from_args(parse("generate", "--prompt", "x", "--config", str(path)))
    monkeypatch.setenv("KVFENCE_INT8", "bogus")
    with pytest.raises(ValueError, match="KVFENCE_INT8='bogus'"):
        config_from_args(parse("generate", "--prompt", "x"))
    with pytest.raises(TypeError, match="unknown configuration field"):
        Config.of(no_such_field=1)


def test_commands_take_only_the_flags_they_act_on():
    """A flag a command would ignore is not offered (argparse refuses it): the router holds no pool, a worker
    serves no HTTP."""
    for command, flag in (("router", "--kv-pages"), ("prefill", "--port"), ("decode", "--transfer-window"),
                          ("generate", "--router"), ("router", "--int8")):  # fmt: skip
        with pytest.raises(SystemExit):
            parse(command, *REQUIRED.get(command, []), flag, "1")


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_prints_its_help(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(command, "--help")
    assert exit_.value.code == 0 and "--config" in capsys.readouterr().out


def test_dest_names_are_section_dot_field():
    args = parse("serve", "--max-num-seqs", "3")
    assert getattr(args, dest("scheduler", "max_num_seqs")) == 3


def test_debug_config_returns_the_effective_tree_to_the_admin_only(tiny_model):
    import httpx

    from tests.server_harness import running_server

    with running_server(
        tiny_model, admin_key="adm", api_keys={"k-alice": "alice"}, kv_canary_interval=7
    ) as srv:
        assert httpx.get(f"{srv.url}/debug/config").status_code == 401
        tenant = httpx.get(f"{srv.url}/debug/config", headers={"Authorization": "Bearer k-alice"})
        assert tenant.status_code == 403  # a tenant's key does not open it
        got = httpx.get(f"{srv.url}/debug/config", headers={"Authorization": "Bearer adm"})
        assert got.status_code == 200
        body = got.json()
        assert body["mode"] == "colocated" and body["config"]["cache"]["kv_canary_interval"] == 7
        assert "admin_key" not in body["config"]["server"] and '"adm"' not in got.text
        assert Config.from_json(json.dumps(body["config"])) == srv.engine.engine.config  # type: ignore[attr-defined]


def test_serve_pd_workers_run_with_the_tree_they_were_sent_and_report_it_when_they_register(tiny_dir):
    """Real worker processes started as `serve --mode pd` starts them (JSON on standard input): each registers
    with the tree it runs, and values no flag was rebuilt for arrive (a field added later arrives the same way)."""
    from kvfence.pd import keys
    from kvfence.pd.router import Router
    from kvfence.runtime.pd import LocalWorkers

    config = Config.of(
        model=str(tiny_dir), dtype="float32", page_size=4, mode="pd", prefill_kv_pages=64, decode_kv_pages=96,
        threads=2, kv_canary_interval=7, prefill_batch_tokens=100, transfer_window=3, share_cores=False,
        admin_key="adm",
    )  # fmt: skip
    keys_dir = keys.ephemeral(prefill=0, decode=0)  # LocalWorkers adds one key per worker it starts
    router = Router(bind="tcp://127.0.0.1:0", cluster_keys=keys.RouterKeys.load(keys_dir))
    with LocalWorkers(router, config, keys_dir) as local:
        assert router.wait_for_workers(1, 1, 120, alive=local.none_given_up)
        reported = {w["role"]: Config.from_json(json.dumps(w["config"])) for w in router.worker_configs()}
    keys.remove(keys_dir)
    assert set(reported) == {"prefill", "decode"}
    for role, got in reported.items():
        assert got.cache.kv_canary_interval == 7 and got.scheduler.prefill_batch_tokens == 100
        assert got.pd.transfer_window == 3 and got.engine.threads == 1 and got.server.admin_key is None
        assert got.pd.router == router.addr
        assert got == worker_configs(config, router.addr, None, keys_dir)[role].replace(admin_key=None)
    assert reported["prefill"].cache.kv_pages == 64 and reported["decode"].cache.kv_pages == 96
