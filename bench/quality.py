"""Numerical quality of every compute path against float32, under every oneDNN ISA cap this CPU can emulate and
with the C++ kernels built for this CPU and for a portable target (issue 20; docs/quality.md).

    .venv/bin/python bench/quality.py                       # the whole corpus, every cap, both builds (~30 min)
    .venv/bin/python bench/quality.py --max-chunks 4 --caps default
    .venv/bin/python bench/quality.py --anchor RESULTS/llamacpp-quality.json   # llama.cpp's row beside ours

Each (cap, build) runs in its own process (`python -m kvfence.model.quality`): oneDNN reads ONEDNN_MAX_CPU_ISA
once, and the kernel build is picked when the kernels load. The corpus is bench/data/kjv.txt (public domain,
10,948 tokens: 21 chunks of 512), scored as llama-perplexity scores it (kvfence/model/quality.py). Prints one
markdown table per mode; --json keeps everything. Numbers do not depend on load, so this may run beside other work.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from kvfence.model.fetch import DEFAULT_MODEL_PATH  # noqa: E402
from kvfence.model.isa import cpu_flags, reachable_caps  # noqa: E402

PORTABLE = "x86-64-v3"  # AVX2 and FMA, no AVX-512: any x86 server CPU of the last ten years


def run_one(cap: str, march: str, args: argparse.Namespace) -> dict[str, object]:
    env = {**os.environ, "KVFENCE_KERNELS_MARCH": march}
    env.pop("ONEDNN_MAX_CPU_ISA", None)
    if cap != "default":
        env["ONEDNN_MAX_CPU_ISA"] = cap
    cmd = [sys.executable, "-m", "kvfence.model.quality", "--model", args.model, "--text", args.text,
           "--ctx", str(args.ctx), "--batch", str(args.batch), "--threads", str(args.threads),
           "--paths", args.paths, "--modes", args.modes]  # fmt: skip
    if args.max_chunks:
        cmd += ["--max-chunks", str(args.max_chunks)]
    start = time.monotonic()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"cap {cap}, march {march}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    result: dict[str, object] = json.loads(proc.stdout)
    result["seconds"] = round(time.monotonic() - start, 1)
    print(f"[quality] cap {cap}, kernels -march={march}: {result['seconds']} s", file=sys.stderr, flush=True)
    return result


def table(runs: list[dict[str, object]], mode: str, anchor: dict[str, object] | None) -> str:
    head = "| path | oneDNN cap | kernels | PPL | KL mean | KL median | KL p99 | KL max | top-1 | max abs dlogit |"
    lines = [head, "|" + " --- |" * 10]
    for run in runs:
        results = run["results"]
        assert isinstance(results, dict)
        for path, s in results[mode].items():
            lines.append(
                f"| {path} | {run['isa_cap']} | {run['kernels_march']} | {s['ppl']:.4f} | {s['kl_mean']:.5f} | "
                f"{s['kl_median']:.5f} | {s['kl_p99']:.4f} | {s['kl_max']:.4f} | {100 * s['top1']:.2f}% | "
                f"{s['max_dlogit']:.3f} |"
            )
    if anchor:
        st = anchor["stats"]
        assert isinstance(st, dict)
        ppl, kl = st["Perplexity statistics"], st["KL divergence statistics"]
        top = st["Token probability statistics"]["Same top p"]["value"]
        lines.append(
            f"| llama.cpp Q4_1 vs its F32 (PPL {anchor['ppl_f32']['value']:.4f}) | its own | - | "  # type: ignore[index]
            f"{ppl['Mean PPL(Q)']['value']:.4f} | {kl['Mean KLD']['value']:.5f} | {kl['Median KLD']['value']:.5f} | "
            f"{kl['99.0% KLD']['value']:.4f} | {kl['Maximum KLD']['value']:.4f} | {top:.2f}% | - |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL_PATH))
    ap.add_argument("--text", default=str(ROOT / "bench" / "data" / "kjv.txt"))
    ap.add_argument("--caps", default="all", help="comma-separated oneDNN caps, or all (every reachable one)")
    ap.add_argument("--portable-caps", default="default,AVX2",
                    help=f"caps also run with the kernels built for -march={PORTABLE} (empty: none)")  # fmt: skip
    ap.add_argument("--paths", default="float32,bf16-torch,bf16-kernels,q-bf16act,default,int8-all")
    ap.add_argument("--modes", default="decode,prefill")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-chunks", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--anchor", default=None, help="llama.cpp's numbers (bench/llamacpp_quality.py --json)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--render", default=None, help="print the tables of an earlier --json, run nothing")
    args = ap.parse_args()
    if args.render:
        saved = json.loads(Path(args.render).read_text())
        print(f"machine: {saved['machine']}")
        for mode in saved["runs"][0]["results"]:
            print(f"\n### {mode}\n")
            print(table(saved["runs"], mode, saved["anchor"]))
        return

    caps = reachable_caps() if args.caps == "all" else [c for c in args.caps.split(",") if c]
    combos = [(c, "native") for c in caps]
    if platform.machine() in ("x86_64", "AMD64"):
        combos += [
            (c, PORTABLE) for c in args.portable_caps.split(",") if c and (c in caps or c == "default")
        ]
    runs = [run_one(cap, march, args) for cap, march in combos]
    anchor = json.loads(Path(args.anchor).read_text()) if args.anchor else None
    flags = cpu_flags()
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    machine = {
        "cpu": next(
            (ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith("model name")), "?"
        ),
        "amx": "amx_tile" in flags,
        "avx512_bf16": "avx512_bf16" in flags,
        "date": time.strftime("%Y-%m-%d"),
    }
    print(f"machine: {machine}; corpus {args.text}; ctx {args.ctx}")
    for mode in args.modes.split(","):
        print(f"\n### {mode}\n")
        print(table(runs, mode, anchor))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine, "runs": runs, "anchor": anchor}, indent=1))


if __name__ == "__main__":
    main()
