"""Issue 5 (assurance), the Spin half: the Promela model of the PD transfer protocol (verify/transfer.pml).

Runs verify/run.py's CI suite: the correct model's safety and liveness checks must verify, and every must-fail
variant (a)-(e) and every finding must be refuted by the property it is expected to break. About two to three
minutes on two cores. Skipped, with the reason, where Spin or gcc is missing and cannot be installed (verify/run.py
tries `apt-get install -y spin gcc` once, as root). docs/verification.md explains the model and the numbers.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]

# `make test` sets KVFENCE_RUN_SPIN=1 (and installs spin and gcc); a bare `pytest` skips the model checks, which
# take about three minutes on two cores (`make verify` runs them alone).
pytestmark = pytest.mark.skipif(
    os.environ.get("KVFENCE_RUN_SPIN") != "1",
    reason="the Spin suite runs under make test (KVFENCE_RUN_SPIN=1) or make verify",
)


def _load_runner() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvfence_verify_run", ROOT / "verify" / "run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


runner = _load_runner()
MUST_FAIL = {"TRUST_DONE": "a", "CHECK_ONCE": "b", "RELEASE_NO_REVOKE": "c", "DRAIN_FIRST_ACK": "d",
             "REUSE_TID": "e"}  # fmt: skip


def test_every_must_fail_switch_exists_and_is_expected_to_be_refuted() -> None:
    """No Spin needed: the suite covers (a)-(e), each a switch the model really has, each expected to fail."""
    model = (ROOT / "verify" / "transfer.pml").read_text()
    for switch, label in MUST_FAIL.items():
        assert re.search(rf"#ifn?def {switch}\b", model), f"({label}) {switch} is not a switch in the model"
        runs = [r for r in runner.CI if f"-D{switch}" in r.defines and r.expect == "fail"]
        assert runs, f"({label}) no must-fail run uses -D{switch}"
        assert any(r.name == label for r in runs), f"({label}) has no run named {label!r}"
    assert {"safety", "liveness"} <= {r.name for r in runner.CI if r.expect == "pass"}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    ok, why = runner.ensure_tools(install=True)
    if not ok:
        pytest.skip(f"the Spin model check needs spin and gcc: {why}")
    out = tmp_path_factory.mktemp("verify")
    return {r.name: r for r in runner.run_suite(runner.CI, out, jobs=2, echo=False)}


@pytest.mark.parametrize("name", [r.name for r in runner.CI])
def test_spin(results: dict[str, Any], name: str) -> None:
    res = results[name]
    events = "\n".join(res.events[-30:])
    assert res.ok, (
        f"{name}: {res.verdict} (expected {res.expect}); {res.detail}\ntrail: {res.trail}\n{events}"
    )


# ---- I10: the cluster-identity model (verify/identity.pml) -------------------------------------------------

IDENTITY = {  # defines -> the assertion Spin must refute, or None: verified
    ("-DAUTH=1", "-DBIND=1"): None,
    ("-DAUTH=1", "-DBIND_OUT=0"): "origin==placed[r]",  # a member answers for a request placed on another
    ("-DAUTH=1", "-DBIND_PAGES=0"): "origin==named[r]",  # a member takes the pages of another's transfer
    ("-DAUTH=0", "-DBIND=1"): "assertionviolated(origin==",  # an intruder without a key names itself a member
}


@pytest.mark.parametrize("defines", sorted(IDENTITY), ids=lambda d: " ".join(d))
def test_identity_model(defines, tmp_path):
    import shutil
    import subprocess

    if shutil.which("spin") is None or shutil.which("gcc") is None:
        pytest.fail("spin and gcc are missing (make test installs them)")
    subprocess.run(["spin", *defines, "-a", str(ROOT / "verify" / "identity.pml")], cwd=tmp_path, check=True,
                   capture_output=True)  # fmt: skip
    subprocess.run(
        ["gcc", "-O2", "-DSAFETY", "-o", "pan", "pan.c"], cwd=tmp_path, check=True, capture_output=True
    )
    out = subprocess.run(
        ["./pan", "-m100000"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    ).stdout
    errors = int(re.search(r"errors: (\d+)", out).group(1))  # type: ignore[union-attr]
    expected = IDENTITY[defines]
    if expected is None:
        assert errors == 0 and "Search not completed" not in out, out
    else:
        assert errors >= 1 and expected in out.replace(" ", ""), out
