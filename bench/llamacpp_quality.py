"""llama.cpp's own KL divergence of the Q4_1 GGUF against the same weights in float32: the anchor of issue 20.

    python bench/llamacpp_quality.py --bin ~/.cache/kvfence/peers/llama.cpp/build/bin [--json PATH]
    bench/peers.sh quality    # builds llama.cpp (build_llamacpp), runs this; results in $RESULTS/quality

1. Writes an F32 GGUF of the model's weights (cached in $PEERS): every metadata key of the Q4_1 file
   (tokenizer, chat template, architecture...) and every tensor dequantized to float32 by
   `gguf.quants.dequantize`, under its own name and shape; general.file_type says ALL_F32. Nothing else
   differs, so llama.cpp runs the same graph on it.
2. `llama-perplexity -m F32.gguf -f bench/data/kjv.txt -c 512 -t 2 --kl-divergence-base BASE.dat` (base run),
   then the same on the Q4_1 file with `--kl-divergence`, which compares its logits with the stored base ones.
3. Parses what llama.cpp prints (the base run's PPL; the statistics sections of the KLD run), prints a
   markdown table and writes JSON (--json), with the logs of both runs next to it.

How llama-perplexity chunks and scores (tools/perplexity/perplexity.cpp, llama.cpp 0c1e570), which is how
kvfence has to be scored to be compared with these numbers:
  - `-f` reads the whole file and drops one trailing "\\n"; no escape processing (escape=false).
  - The whole text is tokenized at once, `common_tokenize(ctx, text, add_special=true, parse_special=false)`.
    A BOS is added only if the vocabulary asks for it (tokenizer.ggml.add_bos_token); the SmolLM2 GGUF says
    false, so no BOS anywhere. (With add_bos, the *first token of each chunk is overwritten* by BOS, not
    shifted.) EOS is never added (asserted).
  - The tokens are cut into n_chunk = floor(n_tokens / 512) back-to-back chunks of 512; the remainder is never
    evaluated. Each chunk is evaluated from an empty KV cache, positions 0..511 (no overlap, no stride).
  - Only the second half is scored: the logits at positions 256..510 predict the tokens at positions 257..511,
    i.e. 255 = n_ctx - 1 - n_ctx/2 tokens per chunk; tokens 0..256 are context only, the logits at 511 unused.
    PPL = exp(mean NLL over all n_chunk * 255 scored tokens).
  - The base file also stores the n_chunk * 512 evaluated token ids; the --kl-divergence run evaluates those
    (it does not tokenize -f again), so both runs see the same tokens.
  - The base file stores, per scored position, the base log-softmax quantized to 16 bits over
    [max - 16, max] of the logits (log-probs more than 16 nats below the top are stored as the floor). The KLD
    run's KL(base || Q) sums p_base * (log p_base - log p_Q) over tokens with log p_base > -16 only; its
    "PPL(base)" comes from those 16-bit log-probs (so it differs from the base run's own PPL in the last
    digits); "Same top p" is the fraction of scored positions where the argmax of the Q logits equals the
    argmax of the stored base log-probs; Δp = p_Q(true token) - p_base(true token).
  - Default batch 2048: 4 chunks go through one batch as 4 sequences (n_seq = 2048 / 512); it does not change
    what is scored.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import gguf
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
PEERS = Path(os.environ.get("PEERS", Path.home() / ".cache/kvfence/peers"))
DEFAULT_MODEL = Path.home() / ".cache/kvfence/models/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DATA = ROOT / "bench/data/kjv.txt"
SKIP_KEYS = ("GGUF.",)  # the reader's pseudo-fields (version, tensor and kv counts): the writer makes its own


def f32_path_for(model: Path) -> Path:
    return PEERS / f"{model.stem}.F32.gguf"


def write_f32(model: Path, out: Path) -> None:
    """The same file with every tensor dequantized to float32 (written to a temporary name, then renamed)."""
    reader = gguf.GGUFReader(model)
    arch = reader.fields["general.architecture"].contents()
    tmp = out.with_name(out.name + ".part")
    writer = gguf.GGUFWriter(tmp, arch)
    for key, field in reader.fields.items():
        # general.architecture: the writer's constructor writes it; general.file_type: ALL_F32 below
        if key.startswith(SKIP_KEYS) or key in ("general.architecture", gguf.Keys.General.FILE_TYPE):
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            if len(field.types) != 2:
                raise SystemExit(f"{key}: nested arrays are not copied by this script")
            writer.add_key_value(key, field.contents(), vtype, sub_type=field.types[1])
        else:
            writer.add_key_value(key, field.contents(), vtype)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:
        # GGUF lists dimensions fastest-first (ne0 = row length); numpy's shape is the reverse, and the
        # writer reverses it back, so the F32 tensor keeps ggml's exact shape.
        want = tuple(int(d) for d in reversed(t.shape.tolist()))
        data = np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        if data.shape != want:
            data = data.reshape(want)
        writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    problem = f32_problem(model, tmp)
    if problem:
        raise SystemExit(f"{tmp}: {problem}")
    os.replace(tmp, out)


def f32_problem(model: Path, f32: Path) -> str | None:
    """None if `f32` has the keys and values of `model` (but the file type) and its tensors' names and shapes,
    all F32; else what differs."""
    try:
        src, dst = gguf.GGUFReader(model), gguf.GGUFReader(f32)
    except (OSError, ValueError) as e:
        return f"unreadable ({e})"
    keys = [k for k in src.fields if not k.startswith(SKIP_KEYS) and k != gguf.Keys.General.FILE_TYPE]
    for k in keys:
        if k not in dst.fields or dst.fields[k].contents() != src.fields[k].contents():
            return f"metadata {k} differs from {model}"
    ftype = dst.fields.get(gguf.Keys.General.FILE_TYPE)
    if ftype is None or ftype.contents() != gguf.LlamaFileType.ALL_F32:
        return "general.file_type is not ALL_F32"
    a = [(t.name, t.shape.tolist()) for t in src.tensors]
    b = [(t.name, t.shape.tolist()) for t in dst.tensors]
    if a != b or any(t.tensor_type != gguf.GGMLQuantizationType.F32 for t in dst.tensors):
        return f"tensors differ in name, shape or type from {model}"
    return None


def ensure_f32(model: Path, out: Path) -> Path:
    """The cached F32 file if it is newer than the model and matches it, else a new one."""
    if out.exists() and out.stat().st_mtime >= model.stat().st_mtime:
        problem = f32_problem(model, out)
        if problem is None:
            return out
        print(f"[quality] {out}: {problem}; writing it anew", file=sys.stderr)
    print(f"[quality] writing {out} (float32 of {model.name})", file=sys.stderr)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_f32(model, out)
    return out


def run(cmd: list[str], log: Path) -> str:
    """Runs a llama.cpp tool, its stdout and stderr into `log`; a crash or a failure stops the script."""
    print(f"[quality] {' '.join(cmd)}", file=sys.stderr)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    log.write_text(proc.stdout)
    if proc.returncode == 132 or proc.returncode == -4:
        raise SystemExit(f"{cmd[0]} died with SIGILL (Illegal instruction): a broken build, see {log}")
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[0]} exited with status {proc.returncode}, see {log}")
    print(f"[quality] done in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return proc.stdout


NUM = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?(?:nan|inf)"
STAT = (
    re.compile(  # "Mean    KLD:   0.012345 ±   0.000123", "RMS Δp    :  1.234 ± 0.012 %", "Maximum Δp: 9.9%"
        rf"^(?P<name>[^:=]*?\S)\s*:\s*(?P<val>{NUM})\s*(?P<pct>%)?\s*(?:±\s*(?P<unc>{NUM})\s*(?P<pct2>%)?)?$"
    )
)


def parse_stats(out: str) -> dict[str, dict[str, dict[str, Any]]]:
    """The `=== NAME ===` sections of a --kl-divergence run: {section: {statistic: {value, unc, unit}}}."""
    sections: dict[str, dict[str, dict[str, Any]]] = {}
    current: dict[str, dict[str, Any]] | None = None
    for line in out.splitlines():
        head = re.match(r"^=+ (.+?) =+$", line.strip())
        if head:
            current = sections.setdefault(head.group(1), {})
            continue
        if current is None:
            continue
        m = STAT.match(line.strip())
        if not m:
            if line.strip():
                current = None  # the sections end at the first other line (the perf report)
            continue
        name = re.sub(r"\s+", " ", m.group("name"))
        unit = "%" if (m.group("pct") or m.group("pct2")) else ""
        stat: dict[str, Any] = {"value": float(m.group("val")), "unit": unit}
        if m.group("unc") is not None:
            stat["unc"] = float(m.group("unc"))
        current[name] = stat
    return sections


def grab(pattern: str, text: str, what: str) -> re.Match[str]:
    m = re.search(pattern, text, re.MULTILINE)
    if not m:
        raise SystemExit(f"llama-perplexity printed no {what} (pattern {pattern!r})")
    return m


def read_base_header(path: Path) -> dict[str, Any]:
    """`_logits_`, n_ctx (u32), n_vocab (i32), n_chunk (i32), then the n_chunk * n_ctx evaluated token ids."""
    with path.open("rb") as f:
        if f.read(8) != b"_logits_":
            raise SystemExit(f"{path} is not a llama-perplexity base file")
        n_ctx, n_vocab, n_chunk = np.frombuffer(f.read(12), dtype="<i4").tolist()
        tokens = np.frombuffer(f.read(4 * n_ctx * n_chunk), dtype="<i4")
    return {"n_ctx": n_ctx, "n_vocab": n_vocab, "n_chunk": n_chunk, "tokens": tokens}


def build_info(bin_dir: Path) -> dict[str, Any]:
    """What peers.sh recorded (sdist, llama.cpp commit, flags) and what CMakeCache.txt says of the build."""
    info: dict[str, Any] = {}
    for stamp in (bin_dir.parent.parent / "kvfence-source.txt", bin_dir.parent / "kvfence-flags.txt"):
        if stamp.exists():
            for line in stamp.read_text().splitlines():
                key, _, value = line.partition(": ")
                info[key.strip()] = value.strip()
    cache = bin_dir.parent / "CMakeCache.txt"
    if cache.exists():
        wanted = (
            "CMAKE_BUILD_TYPE",
            "CMAKE_C_FLAGS",
            "CMAKE_CXX_FLAGS",
            "CMAKE_CXX_COMPILER",
            "GGML_NATIVE",
            "LLAMA_BUILD_COMMIT",
        )
        for line in cache.read_text().splitlines():
            key, _, value = line.partition("=")
            name = key.split(":")[0]
            if name in wanted:
                info[f"cmake {name}"] = value
    return info


def fmt(stat: dict[str, Any] | None, digits: int = 6) -> str:
    if stat is None:
        return ""
    v = f"{stat['value']:.{digits}f}"
    if "unc" in stat:
        v += f" ± {stat['unc']:.{digits}f}"
    return v + (" %" if stat.get("unit") == "%" else "")


def table(result: dict[str, Any]) -> str:
    ppl_f32 = result["ppl_f32"]
    lines = [
        f"llama.cpp {result['llama_cpp_version']}, {result['n_tokens']} tokens of {result['data']}, "
        f"{result['n_chunk']} chunks of {result['n_ctx']}, {result['scored_tokens']} scored tokens "
        f"({result['scored_per_chunk']} per chunk), BOS added: {result['add_bos']}",
        "",
        "| statistic | value |",
        "| --- | --- |",
        f"| PPL F32 (base run: Final estimate) | {ppl_f32['value']:.4f} ± {ppl_f32['unc']:.5f} |",
    ]
    if "ppl_q4_1_over_f32_run" in result:
        lines.append(f"| PPL(Q) / PPL F32 of the base run | {result['ppl_q4_1_over_f32_run']:.6f} |")
    for section, stats in result["stats"].items():
        lines.append(f"| *{section}* | |")
        for name, stat in stats.items():
            lines.append(f"| {name} | {fmt(stat, 3 if stat['unit'] == '%' else 6)} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", type=Path, default=PEERS / "llama.cpp/build/bin", help="llama.cpp's build/bin")
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--f32", type=Path, default=None, help="F32 GGUF to write or reuse (default: in $PEERS)")
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--base", type=Path, default=None, help="keep the base log-probs here (~0.5 GB)")
    ap.add_argument("--json", dest="json_path", type=Path, default=None)
    args = ap.parse_args()

    perplexity = args.bin / "llama-perplexity"
    if not os.access(perplexity, os.X_OK):
        raise SystemExit(f"no {perplexity}: build it with bench/peers.sh (build_llamacpp)")
    f32 = ensure_f32(args.model, args.f32 or f32_path_for(args.model))
    out_dir = args.json_path.parent if args.json_path else Path(tempfile.mkdtemp(prefix="llamacpp-quality-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    PEERS.mkdir(parents=True, exist_ok=True)
    print(f"[quality] logs in {out_dir}", file=sys.stderr)
    stem = args.json_path.stem if args.json_path else "llamacpp-quality"
    version = subprocess.run([str(perplexity), "--version"], capture_output=True, text=True)
    version_line = grab(r"^version: .*$", version.stdout + version.stderr, "version").group(0)

    common = ["-f", str(args.data), "-c", str(args.ctx), "-t", str(args.threads)]
    with tempfile.TemporaryDirectory(prefix="kld-", dir=PEERS) as tmp:
        base = args.base or Path(tmp) / "base.dat"
        out_base = run(
            [str(perplexity), "-m", str(f32), *common, "--kl-divergence-base", str(base)],
            out_dir / f"{stem}.base.log",
        )
        header = read_base_header(base)
        out_kld = run(
            [
                str(perplexity),
                "-m",
                str(args.model),
                *common,
                "--kl-divergence-base",
                str(base),
                "--kl-divergence",
            ],
            out_dir / f"{stem}.kld.log",
        )

    final = grab(rf"Final estimate: PPL = ({NUM}) \+/- ({NUM})", out_base, "final PPL")
    chunks = grab(
        r"calculating perplexity over (\d+) chunks, n_ctx=(\d+), batch_size=(\d+), n_seq=(\d+)",
        out_base,
        "chunk count",
    )
    n_chunk, n_ctx = int(chunks.group(1)), int(chunks.group(2))
    if (n_chunk, n_ctx) != (header["n_chunk"], header["n_ctx"]):
        raise SystemExit(f"base file says {header['n_chunk']} chunks of {header['n_ctx']}, the log otherwise")
    stats = parse_stats(out_kld)
    if "KL divergence statistics" not in stats:
        raise SystemExit("the KLD run printed no statistics (fewer than 100 scored tokens?)")
    tokenize = args.bin / "llama-tokenize"
    n_tokens = None
    if os.access(tokenize, os.X_OK):  # the perplexity tool prints no token count of its own
        tok = subprocess.run(
            [str(tokenize), "-m", str(args.model), "-f", str(args.data), "--ids", "--log-disable"],
            capture_output=True,
            text=True,
            check=True,
        )
        ids = json.loads(tok.stdout.strip().splitlines()[-1])
        n_tokens = len(ids)
        # the same tokenizer call as llama-perplexity's: the base file's tokens are its first chunks
        if ids[: n_chunk * n_ctx] != header["tokens"].tolist():
            raise SystemExit("llama-tokenize and llama-perplexity tokenized the text differently")
    # the base file holds the tokens as tokenized (written before any chunk is evaluated), so its first token
    # is the BOS exactly when llama.cpp added one
    meta = gguf.GGUFReader(args.model).fields
    bos_id = meta["tokenizer.ggml.bos_token_id"].contents() if "tokenizer.ggml.bos_token_id" in meta else None
    add_bos = bos_id is not None and int(header["tokens"][0]) == bos_id
    add_bos_key = (
        meta["tokenizer.ggml.add_bos_token"].contents() if "tokenizer.ggml.add_bos_token" in meta else None
    )
    per_chunk = n_ctx - 1 - n_ctx // 2
    scored = n_chunk * per_chunk
    n_kld_chunks = len(re.findall(r"^\s*\d+\s+\S+ ± ", out_kld, re.MULTILINE))  # its per-chunk rows
    if n_kld_chunks != n_chunk:
        raise SystemExit(f"the KLD run printed {n_kld_chunks} chunk rows, the base run had {n_chunk} chunks")
    result: dict[str, Any] = {
        "model": str(args.model),
        "model_sha256": hashlib.sha256(args.model.read_bytes()).hexdigest(),
        "f32_model": str(f32),
        "data": str(args.data.relative_to(ROOT) if args.data.is_relative_to(ROOT) else args.data),
        "llama_cpp_version": version_line.removeprefix("version: "),
        "build": build_info(args.bin),
        "cpu": next(
            (
                ln.split(":", 1)[1].strip()
                for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")
            ),
            platform.processor(),
        ),
        "threads": args.threads,
        "n_ctx": n_ctx,
        "n_tokens": n_tokens,
        "n_chunk": n_chunk,
        "n_kld_chunks_printed": n_kld_chunks,
        "batch_size": int(chunks.group(3)),
        "n_seq": int(chunks.group(4)),
        "add_bos": add_bos,
        "gguf_add_bos_token": add_bos_key,
        "bos_token_id": bos_id,
        "scored_per_chunk": per_chunk,
        "scored_tokens": scored,
        "evaluated_tokens_sha256": hashlib.sha256(header["tokens"].astype("<i4").tobytes()).hexdigest(),
        "ppl_f32": {"value": float(final.group(1)), "unc": float(final.group(2))},
        "stats": stats,
        "commands": {
            "base": f"llama-perplexity -m {f32} {' '.join(common)} --kl-divergence-base BASE.dat",
            "kld": f"llama-perplexity -m {args.model} {' '.join(common)} --kl-divergence-base BASE.dat "
            "--kl-divergence",
        },
    }
    ppl_q = stats.get("Perplexity statistics", {}).get("Mean PPL(Q)")
    if ppl_q is not None:
        result["ppl_q4_1_over_f32_run"] = ppl_q["value"] / result["ppl_f32"]["value"]
    if any(not math.isfinite(s["value"]) for sec in stats.values() for s in sec.values()):
        raise SystemExit("llama-perplexity printed a non-finite statistic: see the logs")
    text = table(result)
    print(text)
    if args.json_path:
        args.json_path.write_text(json.dumps(result, indent=2) + "\n")
        args.json_path.with_suffix(".md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
