"""Outside-in checks for any OpenAI-compatible deployment (kvfence, vLLM, SGLang): `kvfence probe` and
`kvfence audit` (docs/probe.md).

Boundary: these tools only speak HTTP to a server and read its log files; nothing here imports the engine, the
KV pool or torch, so they judge kvfence exactly as they judge any other server.

- `canary.py`: tenant A's secrets and the leak test (a secret, or a long enough piece of one, in a reply).
- `prompts.py`: filler text, the canary prompts, and the token-count model used to size prompts.
- `plan.py`: the attack mix as a list of jobs (who sends what, and what a correct server must answer).
- `client.py`: one job over HTTP (streamed or not, aborted or not), timed.
- `calibrate.py`: discovery (models, context length, keys, /tokenize) and calibration (token counts, prefill rate).
- `findings.py` and `stats.py`: results to findings; the Mann-Whitney U test for prefix-cache timing.
- `probe.py`: runs a plan against a target within its request and time bounds; `report.py`: summary and JSON.
- `audit.py`: startup logs to per-node KV pool vs context verdicts.
"""
