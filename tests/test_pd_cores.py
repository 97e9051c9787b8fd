"""Core sharing between the PD workers of one host (kvfence/pd/cores.py): alone, a worker steps on all the
cores; with another worker busy, on its own share."""

from __future__ import annotations

import pytest

from kvfence.pd import cores
from kvfence.pd.cores import CoreShare


def pair(tmp_path, threads: int, max_threads: int) -> tuple[CoreShare, CoreShare]:
    path = cores.create(tmp_path / "share")
    return (CoreShare(path, "prefill", threads, max_threads), CoreShare(path, "decode", threads, max_threads))


def test_a_worker_alone_steps_on_every_core_and_on_its_share_with_company(tmp_path):
    prefill, decode = pair(tmp_path, threads=1, max_threads=2)
    assert prefill.step_threads(busy=True) == 2  # one request's prefill, decode idle: the whole machine
    assert decode.step_threads(busy=True) == 1  # its transfer landed: both busy, one core each
    assert prefill.step_threads(busy=True) == 1
    assert prefill.step_threads(busy=False) == 1  # an idle worker's answer is not used
    assert decode.step_threads(busy=True) == 2  # decode alone again
    prefill.close()  # an exiting worker leaves its slot idle
    assert decode.step_threads(busy=True) == 2
    decode.close()
    assert (tmp_path / "share").read_bytes() == bytes(cores.SLOTS)


@pytest.mark.parametrize("right_after_the_step", [False, True])
def test_a_worker_that_turns_idle_frees_the_cores_for_the_other(tmp_path, right_after_the_step):
    """Idle at its next step, or at once: the decode worker's last step ends a request, and it publishes that
    before it waits on its sockets, so the next prompt's prefill (arriving meanwhile) runs on every core."""
    prefill, decode = pair(tmp_path, threads=2, max_threads=4)
    decode.step_threads(busy=True)
    assert prefill.step_threads(busy=True) == 2
    if right_after_the_step:
        decode.publish(busy=False)
    else:
        decode.step_threads(busy=False)
    assert prefill.step_threads(busy=True) == 4


@pytest.mark.parametrize(("threads", "max_threads"), [(0, 2), (3, 2)])
def test_thread_counts_are_checked(tmp_path, threads, max_threads):
    with pytest.raises(ValueError):
        CoreShare(cores.create(tmp_path / "share"), "decode", threads, max_threads)
