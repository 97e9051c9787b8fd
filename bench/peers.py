"""Helpers for bench/peers.sh: the same weights for every peer, the transformers baseline, and the table.

    python bench/peers.py export-hf OUT_DIR [--model GGUF]      # GGUF -> Hugging Face folder (for vLLM)
    python bench/peers.py transformers --hf-dir DIR --workload W1 --json OUT   # offline HF generate
    python bench/peers.py table RESULTS_DIR                     # one markdown table from bench/serve.py JSONs
    python bench/peers.py scale-table RESULTS_DIR/scale/SIZE    # the same for bench/peers.sh scale (W3-W6)

export-hf dequantizes the GGUF with kvfence's own loader (the weights every peer but llama.cpp then serves) and
writes float32 safetensors, a transformers config and the tokenizer (transformers reads it from the GGUF).
The transformers baseline runs the serving workloads offline: W1 as static batches of `concurrency` prompts
(left-padded, greedy, exactly `output_len` new tokens), W2 one prompt at a time, timing the first token
separately; its JSON has the keys of bench/serve.py's that apply.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from kvfence.model.fetch import DEFAULT_MODEL_PATH
from kvfence.model.loader import load_model, load_tokenizer

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from serve import WORKLOADS, Workload, make_prompts  # noqa: E402  (bench/ is not a package)

# and then off the path: bench/kernels.py would shadow the `kernels` package that transformers imports
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]


def export_hf(out: Path, model_path: str) -> None:
    import transformers
    from safetensors.torch import save_file

    loaded = load_model(model_path)
    cfg = loaded.config
    out.mkdir(parents=True, exist_ok=True)
    fields: dict[str, Any] = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.context_length,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=list(cfg.eos_token_ids),
    )
    hf_cfg = transformers.LlamaConfig(**fields)
    hf_cfg.architectures = ["LlamaForCausalLM"]
    hf_cfg.save_pretrained(out)
    save_file({k: v.contiguous() for k, v in loaded.weights.items()}, str(out / "model.safetensors"))
    gguf = Path(model_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer.save_pretrained(out)
    print(f"wrote {out}")


def transformers_baseline(hf_dir: str, w: Workload, tokenizer_path: str, threads: int) -> dict[str, Any]:
    import transformers

    torch.set_num_threads(threads)
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    tok.padding_side = "left"
    tok.pad_token = tok.pad_token or tok.eos_token
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.eval()  # type: ignore[no-untyped-call]
    prompts = [p for p, _ in make_prompts(load_tokenizer(tokenizer_path), w)]
    batch = w.concurrency or 1

    def generate(texts: list[str], new_tokens: int) -> int:
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():
            out = model.generate(
                **enc,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
            )
        return int(out.shape[0] * (out.shape[1] - enc["input_ids"].shape[1]))

    generate(prompts[:batch], 2)  # warm-up
    ttft, tpot, generated = [], [], 0
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        if batch == 1:  # the first token alone, then the whole request: decode time per token by difference
            t0 = time.perf_counter()
            generate(chunk, 1)
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            generated += generate(chunk, w.output_len)
            total = time.perf_counter() - t0
            ttft.append(first)
            tpot.append((total - first) / (w.output_len - 1))
        else:
            generated += generate(chunk, w.output_len)
    elapsed = time.perf_counter() - start - sum(ttft)  # the batch-1 first-token probes are not throughput
    ms = 1000.0
    return {
        "label": "transformers",
        "workload": asdict(w),
        "num_ok": len(prompts),
        "num_failed": 0,
        "elapsed_s": round(elapsed, 3),
        "output_tok_s": round(generated / elapsed, 2),
        "ttft_ms": {"p50": round(statistics.median(ttft) * ms, 2) if ttft else None},
        "tpot_ms": {"p50": round(statistics.median(tpot) * ms, 2) if tpot else None},
    }


def table(results: Path) -> str:
    """Rows: one per label; columns: W1 output tok/s and TTFT p50, W2 TTFT p50 and decode ms/token, RSS."""
    rows: dict[str, dict[str, dict[str, Any]]] = {}
    for path in sorted(results.glob("*.json")):
        label, workload = path.stem.rsplit(".", 1)
        rows.setdefault(label, {})[workload] = json.loads(path.read_text())

    def cell(d: dict[str, Any] | None, *keys: str) -> str:
        value: Any = d
        for k in keys:
            value = value.get(k) if isinstance(value, dict) else None
        return "" if value is None else str(value)

    lines = [
        "| server | W1 out tok/s | W1 TTFT p50 ms | W1 failed | W2 TTFT p50 ms | W2 decode ms/token | RSS MiB |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, r in rows.items():
        w1, w2 = r.get("W1"), r.get("W2")
        rss = results / f"{label}.rss"  # every process of the server after W1 and W2 (peers.sh record_rss)
        lines.append(
            f"| {label} | {cell(w1, 'output_tok_s')} | {cell(w1, 'ttft_ms', 'p50')} | {cell(w1, 'num_failed')} "
            f"| {cell(w2, 'ttft_ms', 'p50')} | {cell(w2, 'tpot_ms', 'p50')} "
            f"| {rss.read_text().strip() if rss.exists() else ''} |"
        )
    return "\n".join(lines)


SCALE_FILE = re.compile(r"^(?P<label>.+)\.(?P<w>W[13-6])(?:\.r(?P<rate>[0-9.]+))?\.json$")


def scale_table(results: Path) -> str:
    """bench/peers.sh scale's results for one model: a row per server; (W1 if run,) W3-W5 output tok/s and TTFT
    p50 (ms), W5 and W6 inter-token p99, W6 goodput at each rate (requests/s meeting the SLO / offered), RSS."""
    runs: dict[str, dict[str, dict[str, Any]]] = {}
    for path in sorted(results.glob("*.json")):
        m = SCALE_FILE.match(path.name)
        if m:
            key = m["w"] + (f"@{m['rate']}" if m["rate"] else "")
            runs.setdefault(m["label"], {})[key] = json.loads(path.read_text())
    rates = sorted({k.split("@")[1] for r in runs.values() for k in r if "@" in k}, key=float)

    def closed(d: dict[str, Any] | None) -> str:
        if d is None:
            return " | "
        failed = f" ({d['num_failed']} failed)" if d["num_failed"] else ""
        return f"{d['output_tok_s']}{failed} | {d['ttft_ms']['p50']}"

    def good(d: dict[str, Any] | None) -> str:
        if d is None:
            return ""
        return f"{d['goodput_req_s']} ({d['num_good']}/{d['workload']['num_requests']}; ITL p99 {d['itl_ms']['p99']})"

    w1 = any("W1" in r for r in runs.values())  # W1 only where it was asked for (PD against colocated)
    head = ["server"] + (["W1 tok/s", "W1 TTFT p50"] if w1 else []) + ["W3 tok/s", "W3 TTFT p50", "W4 tok/s",
            "W4 TTFT p50", "W5 tok/s", "W5 TTFT p50", "W5 ITL p99"] + [f"W6 goodput @{r}/s" for r in rates] + [
            "RSS MiB"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for label, r in runs.items():
        rss = results / f"{label}.rss"
        w5 = r.get("W5")
        lines.append(
            f"| {label} | {closed(r.get('W1')) + ' | ' if w1 else ''}{closed(r.get('W3'))} | {closed(r.get('W4'))} | "
            f"{closed(w5)} | "
            f"{w5['itl_ms']['p99'] if w5 else ''} | "
            + " | ".join(good(r.get(f"W6@{rate}")) for rate in rates)
            + f"{' | ' if rates else ''}{rss.read_text().strip() if rss.exists() else ''} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export-hf")
    e.add_argument("out", type=Path)
    e.add_argument("--model", default=str(DEFAULT_MODEL_PATH))
    t = sub.add_parser("transformers")
    t.add_argument("--hf-dir", required=True)
    t.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    t.add_argument("--tokenizer", default=str(DEFAULT_MODEL_PATH))
    t.add_argument("--threads", type=int, default=2)
    t.add_argument("--json", dest="json_path", required=True)
    tb = sub.add_parser("table")
    tb.add_argument("results", type=Path)
    st = sub.add_parser("scale-table")
    st.add_argument("results", type=Path)
    args = ap.parse_args()
    if args.cmd == "export-hf":
        export_hf(args.out, args.model)
    elif args.cmd == "transformers":
        w = Workload(**WORKLOADS[args.workload], rate=None, seed=0)
        summary = transformers_baseline(args.hf_dir, w, args.tokenizer, args.threads)
        Path(args.json_path).write_text(json.dumps(summary, indent=2))
        print(json.dumps(summary))
    elif args.cmd == "scale-table":
        print(scale_table(args.results))
    else:
        print(table(args.results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
