"""Control-plane messages between router and workers: small JSON objects, one per ZeroMQ frame.

worker -> router   register {role, fingerprint, data_addr}        router -> worker  registered | refused
router -> prefill  prefill {request_id, prompt_ids, params, tenant}
router -> decode   expect {request_id, transfer_id, prompt_ids, params, tenant, prefill_addr}
router -> worker   abort {request_id} | shutdown
decode -> router   output {RequestOutput fields}
worker -> router   error {request_id, code, message, status}      (admission failures, prefill failures)
router -> worker   debug_kv {nonce}; worker -> router debug_kv {nonce, snapshot}   (the KV page map)
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from typing import Any

from kvfence.engine.output import RequestOutput
from kvfence.engine.request import SamplingParams
from kvfence.ids import RequestId


def pack(op: str, **body: Any) -> bytes:
    return json.dumps({"op": op, **body}, separators=(",", ":")).encode()


def unpack(frame: bytes) -> dict[str, Any]:
    message = json.loads(frame)
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
        raise ValueError("control message without an op")
    return message


def params_to_json(params: SamplingParams) -> dict[str, Any]:
    return asdict(params)


def params_from_json(raw: dict[str, Any]) -> SamplingParams:
    known = {f.name for f in fields(SamplingParams)}
    values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items() if k in known}
    return SamplingParams(**values)


def output_to_json(out: RequestOutput) -> dict[str, Any]:
    return asdict(out)


def output_from_json(raw: dict[str, Any]) -> RequestOutput:
    logprobs = tuple((c, tuple((int(t), float(lp)) for t, lp in top)) for c, top in raw.get("logprobs", ()))
    return RequestOutput(
        request_id=RequestId(raw["request_id"]),
        new_token_ids=tuple(raw["new_token_ids"]),
        new_text=raw["new_text"],
        finished=raw["finished"],
        finish_reason=raw["finish_reason"],
        error_code=raw["error_code"],
        num_prompt_tokens=raw["num_prompt_tokens"],
        num_output_tokens=raw["num_output_tokens"],
        text=raw["text"],
        token_ids=tuple(raw["token_ids"]),
        logprobs=logprobs,
    )
