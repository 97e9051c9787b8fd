"""The first token in PD mode: the prefill worker sends it as soon as it is sampled, and the router hands the
client each token and each character once, although the decode worker's outputs carry the first token again."""

from __future__ import annotations

from kvfence.engine.output import RequestOutput
from kvfence.ids import RequestId
from kvfence.pd import control
from kvfence.pd.router_core import _Routed, _unseen


def output(tokens: list[int], new: int, text: str, new_text: str, finished: bool = False) -> RequestOutput:
    return RequestOutput(
        request_id=RequestId("r"), new_token_ids=tuple(tokens[-new:]) if new else (), new_text=new_text,
        finished=finished, finish_reason="length" if finished else None, error_code=None, num_prompt_tokens=5,
        num_output_tokens=len(tokens), text=text, token_ids=tuple(tokens),
        logprobs=tuple((-0.1 * t, ()) for t in tokens[-new:]) if new else (),
    )  # fmt: skip


def client_view(outputs: list[RequestOutput]) -> tuple[list[int], str, int]:
    routed = _Routed(prompt_len=5, prefill=b"p", decode=b"d", on_output=lambda out: None)
    seen = [_unseen(routed, out) for out in outputs]
    return (
        [t for o in seen for t in o.new_token_ids],
        "".join(o.new_text for o in seen),
        sum(len(o.logprobs) for o in seen),
    )


def test_the_first_token_is_not_shown_twice():
    prefill = output([7], 1, "Hi", "Hi")
    decode = [
        output([7, 8], 2, "Hi there", "Hi there"),
        output([7, 8, 9], 1, "Hi there!", "!", finished=True),
    ]
    assert client_view([prefill, *decode]) == ([7, 8, 9], "Hi there!", 3)
    assert client_view(decode) == ([7, 8, 9], "Hi there!", 3)  # without the early token: unchanged


def test_text_the_decode_worker_still_holds_back_is_not_repeated_later():
    """The prefill worker showed "wh"; the decode worker holds back the first two tokens (a split character),
    then releases them with the third: the client gets the rest once."""
    prefill = output([7], 1, "wh", "wh")
    decode = [output([7, 8], 2, "", ""), output([7, 8, 9], 1, "wh\u00e9x", "wh\u00e9x", finished=True)]
    assert client_view([prefill, *decode]) == ([7, 8, 9], "wh\u00e9x", 3)


def test_the_router_takes_only_a_first_token_from_a_prefill_worker():
    """A prefill worker's output counts only as the first token, unfinished; anything else it claims (a second
    token, a finished answer) is dropped, and decode's outputs go through."""
    from kvfence.engine.request import SamplingParams
    from kvfence.pd.router import RouterCore

    core = RouterCore()
    core._send = lambda *a, **kw: None  # type: ignore[method-assign]  # no sockets here
    fp = {
        "layout": "l",
        "vocab_size": 10,
        "context_length": 64,
        "pool_pages": 16,
        "page_size": 4,
        "scheduling_policy": "vtc",
    }
    core.on_message(b"P", control.Register("prefill", fp, "tcp://127.0.0.1:9"))
    core.on_message(b"D", control.Register("decode", fp))
    seen: list[RequestOutput] = []
    core.route([1, 2, 3], SamplingParams(max_tokens=3), RequestId("r"), "t", seen.append)

    def send(sender: bytes, out: RequestOutput) -> None:
        core.on_frame(sender, control.encode(control.Output(out)))  # through the codec, as from a socket

    send(b"P", output([7, 8], 1, "ab", "b"))  # not a first token: dropped
    send(b"P", output([7], 1, "a", "a"))
    send(b"P", output([7], 1, "a", "a", finished=True))  # a prefill worker does not finish requests
    send(b"D", output([7, 8], 2, "ab", "ab"))
    send(b"D", output([7, 8, 9], 1, "abc", "c", finished=True))
    assert [(o.new_token_ids, o.new_text, o.finished) for o in seen] == [
        ((7,), "a", False),
        ((8,), "b", False),
        ((9,), "c", True),
    ]
