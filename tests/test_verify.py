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
