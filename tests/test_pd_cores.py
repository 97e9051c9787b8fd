"""Core sharing between the PD workers of one host (kvfence/pd/cores.py): alone, a worker steps on all the
cores; with another worker busy, on its own share."""

from __future__ import annotations

import pytest

from kvfence.pd import cores
from kvfence.pd.cores import CoreShare


def test_a_worker_alone_steps_on_every_core_and_on_its_share_with_company(tmp_path):
    path = cores.create(tmp_path / "share")
    prefill = CoreShare(path, "prefill", threads=1, max_threads=2)
    decode = CoreShare(path, "decode", threads=1, max_threads=2)
    assert prefill.step_threads(busy=True) == 2  # one request's prefill, decode idle: the whole machine
    assert decode.step_threads(busy=True) == 1  # its transfer landed: both busy, one core each
    assert prefill.step_threads(busy=True) == 1
    assert prefill.step_threads(busy=False) == 1  # an idle worker's answer is not used
    assert decode.step_threads(busy=True) == 2  # decode alone again
    prefill.close()  # an exiting worker leaves its slot idle
    assert decode.step_threads(busy=True) == 2
    decode.close()
    assert path.read_bytes() == bytes(cores.SLOTS)


def test_a_worker_that_turns_idle_frees_the_cores_for_the_other(tmp_path):
    path = cores.create(tmp_path / "share")
    prefill = CoreShare(path, "prefill", threads=2, max_threads=4)
    decode = CoreShare(path, "decode", threads=2, max_threads=4)
    decode.step_threads(busy=True)
    assert prefill.step_threads(busy=True) == 2
    decode.step_threads(busy=False)
    assert prefill.step_threads(busy=True) == 4


def test_a_worker_that_ran_out_of_work_stops_looking_busy_at_once(tmp_path):
    """The decode worker's last step ends a request; before it waits on its sockets it publishes that it is
    idle, so the next prompt's prefill (which arrives while it waits) runs on every core."""
    path = cores.create(tmp_path / "share")
    prefill = CoreShare(path, "prefill", threads=1, max_threads=2)
    decode = CoreShare(path, "decode", threads=1, max_threads=2)
    decode.step_threads(busy=True)
    assert prefill.step_threads(busy=True) == 1
    decode.publish(busy=False)
    assert prefill.step_threads(busy=True) == 2


@pytest.mark.parametrize(("threads", "max_threads"), [(0, 2), (3, 2)])
def test_thread_counts_are_checked(tmp_path, threads, max_threads):
    with pytest.raises(ValueError):
        CoreShare(cores.create(tmp_path / "share"), "decode", threads, max_threads)
