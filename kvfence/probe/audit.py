"""`kvfence audit`: read servers' startup logs and say, per node, whether its KV pool holds one full-context
request (I6, the configuration behind the 2026 incident).

Pure parsing over text; `audit_files` only reads the files. A node is one KV pool with its own limit:

- kvfence: one `kvfence preflight` block (the pool line, the context line, kvfence's own verdict); a PD setup
  prints one per worker.
- SGLang: the `KV Cache is allocated. #tokens: N, K size: .., V size: ..` lines of its tensor-parallel ranks (or
  the MLA form `#tokens: N, KV size: ..`), closed by the scheduler's `max_total_num_tokens=N, ...,
  context_len=C` line. A second startup in the same file is a second node.
- vLLM: one `GPU KV cache size: N tokens` line (vLLM-CPU: `CPU KV cache size: N tokens`) per engine core (one
  per data-parallel rank), with its `Maximum concurrency for L tokens per request: Xx` (0.32: on the same line);
  L is the max model length. Without it the context comes from `max_seq_len=` in the engine config line, or
  `'max_model_len': L` in the non-default args.

Numbers are only ever read, never inferred: a node missing its pool or its context is reported as partial, and
a file with none of these lines as unknown. The one derived verdict is vLLM's own concurrency figure (X < 1 means
the pool holds less than one request of L tokens) when its pool line is missing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any


class Status(Enum):
    OK = "ok"
    UNDERSIZED = "undersized"
    PARTIAL = "partial"
    UNKNOWN = "unknown"
    UNREADABLE = "unreadable"


_KVFENCE_HEADER = re.compile(r"kvfence preflight\s*$")
_KVFENCE_MODEL = re.compile(r"\bmodel {2,}(\S+)")
_KVFENCE_POOL = re.compile(r"KV pool\s+(\d+) pages x (\d+) tokens = (\d+) tokens")
_KVFENCE_CONTEXT = re.compile(r"context length\s+(\d+) \(model \d+, requested \d+\)")
_KVFENCE_VERDICT = re.compile(r"verdict\s+([a-z ()]+):")
_SGLANG_KV = re.compile(
    r"\bKV Cache is allocated\. #tokens: (\d+), (?:K size: ([\d.]+) GB|KV size: ([\d.]+) GB)"
)
_SGLANG_TOTAL = re.compile(r"\bmax_total_num_tokens=(\d+)")
_SGLANG_CONTEXT = re.compile(r"\bcontext_len=(\d+)")
_SGLANG_RANK = re.compile(r"\b((?:DP\d+ )?(?:PP\d+ )?TP\d+)\]")
_VLLM_KV = re.compile(r"(?:GPU|CPU) KV cache size: ([\d,]+) tokens")  # CPU: vLLM-CPU
_VLLM_CONCURRENCY = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")
_VLLM_PROCESS = re.compile(r"\(([A-Za-z_]+\w*) pid=\d+\)")
_VLLM_SEQ_LEN = re.compile(r"\bmax_seq_len=(\d+)")
_VLLM_ARG = re.compile(r"'max_model_len': (\d+)")


@dataclass
class Node:
    file: str
    line: int  # 1-based line where the node's first record is
    source: str  # "kvfence" | "sglang" | "vllm"
    label: str
    pool_tokens: int | None = None
    context_length: int | None = None
    context_from: str | None = None
    concurrency: float | None = None  # vLLM's own "Maximum concurrency" figure
    facts: dict[str, str] = field(default_factory=dict)  # other numbers worth showing (sizes, verdicts)

    @property
    def status(self) -> Status:
        if self.pool_tokens is not None and self.context_length is not None:
            return Status.OK if self.pool_tokens >= self.context_length else Status.UNDERSIZED
        if self.concurrency is not None and self.context_length is not None:
            if self.concurrency < 1.0:
                return Status.UNDERSIZED
            if self.concurrency >= 1.01:  # printed with two decimals: 1.00x may be 0.996
                return Status.OK
        return Status.PARTIAL

    def verdict(self) -> str:
        pool, ctx = self.pool_tokens, self.context_length
        status = self.status
        if status is Status.PARTIAL:
            missing = [name for name, v in (("KV pool size", pool), ("context length", ctx)) if v is None]
            return f"partial: no {' and no '.join(missing) or 'usable figure'} in the log; not judged"
        if pool is None:
            assert self.concurrency is not None and ctx is not None
            label = "UNDERSIZED" if status is Status.UNDERSIZED else "ok"
            return f"{label}: by the server's own figure, {self.concurrency:.2f} requests of {ctx} tokens fit at once"
        assert ctx is not None
        if status is Status.UNDERSIZED:
            return (
                f"UNDERSIZED: the pool holds {pool} tokens, less than one full-context request of {ctx} "
                f"tokens; prompts between {pool} and {ctx} tokens are the 2026 incident's trigger"
            )
        return f"ok: the pool holds {pool // ctx} full-context request(s) of {ctx} tokens ({pool} tokens)"

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "line": self.line,
            "source": self.source,
            "label": self.label,
            "pool_tokens": self.pool_tokens,
            "context_length": self.context_length,
            "context_from": self.context_from,
            "concurrency": self.concurrency,
            "facts": self.facts,
            "status": self.status.value,
            "verdict": self.verdict(),
        }


@dataclass(frozen=True, slots=True)
class FileAudit:
    file: str
    nodes: list[Node]
    problem: str | None = None  # unreadable, or no known line at all

    @property
    def status(self) -> Status:
        if self.problem is not None:
            return Status.UNREADABLE if not self.problem.startswith("no ") else Status.UNKNOWN
        return Status.OK


@dataclass(frozen=True, slots=True)
class Audit:
    files: list[FileAudit]

    @property
    def nodes(self) -> list[Node]:
        return [n for f in self.files for n in f.nodes]

    @property
    def exit_status(self) -> int:
        """1: a node is undersized; 2: something could not be judged (partial, unknown, unreadable); 0: ok."""
        if any(n.status is Status.UNDERSIZED for n in self.nodes):
            return 1
        if any(f.problem for f in self.files) or any(n.status is not Status.OK for n in self.nodes):
            return 2
        return 0

    def summary(self) -> str:
        lines = []
        for f in self.files:
            lines.append(f"{f.file}:")
            if f.problem:
                lines.append(f"  {f.status.value}: {f.problem}")
            for n in f.nodes:
                facts = "".join(f", {k} {v}" for k, v in n.facts.items())
                facts += f", concurrency {n.concurrency:.2f}x" if n.concurrency is not None else ""
                pool = "?" if n.pool_tokens is None else n.pool_tokens
                ctx = "?" if n.context_length is None else n.context_length
                lines.append(
                    f"  {n.source} {n.label} (line {n.line}): KV pool {pool} tokens, context {ctx}"
                    f"{f' ({n.context_from})' if n.context_from else ''}{facts}"
                )
                lines.append(f"    {n.verdict()}")
        counts = {s: sum(n.status is s for n in self.nodes) for s in Status}
        tally = ", ".join(f"{v} {s.value}" for s, v in counts.items() if v)
        lines.append(f"{len(self.nodes)} node(s): {tally or 'none recognized'}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "tool": "kvfence audit",
            "exit_status": self.exit_status,
            "files": [
                {
                    "file": f.file,
                    "status": f.status.value,
                    "problem": f.problem,
                    "nodes": [n.to_json() for n in f.nodes],
                }
                for f in self.files
            ],
        }


def audit_files(paths: list[Path]) -> Audit:
    files = []
    for path in paths:
        try:
            text = path.read_text(errors="replace")
        except OSError as exc:
            files.append(FileAudit(str(path), [], f"cannot read: {exc.strerror or exc}"))
            continue
        files.append(audit_text(str(path), text))
    return Audit(files)


def audit_text(name: str, text: str) -> FileAudit:
    nodes = _Parser(name).parse(text.splitlines())
    if not nodes:
        return FileAudit(name, [], "no KV pool or context-length line from kvfence, SGLang or vLLM")
    return FileAudit(name, nodes)


def _int(s: str) -> int:
    return int(s.replace(",", ""))


class _Parser:
    """One pass over a file's lines; each format keeps its own current node."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.nodes: list[Node] = []
        self.kvfence: Node | None = None
        self.sglang: Node | None = None
        self.sglang_ranks: set[str] = set()
        self.sglang_kv: list[int] = []
        self.vllm_context: tuple[int, str] | None = None  # file-level max model length for vLLM nodes

    def parse(self, lines: list[str]) -> list[Node]:
        for number, line in enumerate(lines, start=1):
            self._kvfence(number, line)
            self._sglang(number, line)
            self._vllm(number, line)
        for node in self.nodes:
            if node.source == "vllm" and node.context_length is None and self.vllm_context is not None:
                node.context_length, node.context_from = self.vllm_context
        return self.nodes

    def _new(self, number: int, source: str, label: str) -> Node:
        node = Node(self.name, number, source, label)
        self.nodes.append(node)
        return node

    def _kvfence(self, number: int, line: str) -> None:
        if _KVFENCE_HEADER.search(line):
            count = sum(n.source == "kvfence" for n in self.nodes) + 1
            self.kvfence = self._new(number, "kvfence", f"preflight #{count}")
            return
        node = self.kvfence
        if node is None:
            return
        if (m := _KVFENCE_POOL.search(line)) and node.pool_tokens is None:
            node.pool_tokens = int(m.group(3))
            node.facts["pages"] = f"{m.group(1)} x {m.group(2)}"
        elif (m := _KVFENCE_CONTEXT.search(line)) and node.context_length is None:
            node.context_length, node.context_from = int(m.group(1)), "preflight: advertised"
        elif (m := _KVFENCE_VERDICT.search(line)) and "verdict" not in node.facts:
            node.facts["verdict"] = m.group(1).strip()
            self.kvfence = None  # the verdict closes the block
        elif (m := _KVFENCE_MODEL.search(line)) and "model" not in node.facts:
            node.facts["model"] = m.group(1)

    def _sglang(self, number: int, line: str) -> None:
        if m := _SGLANG_KV.search(line):
            rank = r.group(1) if (r := _SGLANG_RANK.search(line)) else "rank ?"
            if self.sglang is None or self._sglang_closed() or rank in self.sglang_ranks:
                self._start_sglang(number)
            node = self.sglang
            assert node is not None
            self.sglang_ranks.add(rank)
            self.sglang_kv.append(int(m.group(1)))
            node.pool_tokens = min(self.sglang_kv)  # ranks agree; if not, the smallest pool is the limit
            node.label = f"server ({', '.join(sorted(self.sglang_ranks))})"
            node.facts["kv_size"] = (
                f"K {m.group(2)} GB + V {m.group(2)} GB" if m.group(2) else f"{m.group(3)} GB (MLA)"
            )
        elif m := _SGLANG_TOTAL.search(line):
            if self.sglang is None or self._sglang_closed():
                self._start_sglang(number)
            node = self.sglang
            assert node is not None
            node.pool_tokens = int(m.group(1))  # what the scheduler admits against
            node.facts["max_total_num_tokens"] = m.group(1)
            if c := _SGLANG_CONTEXT.search(line):
                node.context_length, node.context_from = int(c.group(1)), "context_len"

    def _start_sglang(self, number: int) -> None:
        self.sglang = self._new(number, "sglang", "server")
        self.sglang_ranks, self.sglang_kv = set(), []

    def _sglang_closed(self) -> bool:
        """The scheduler's summary line ends a startup: KV lines after it belong to the next one."""
        return self.sglang is not None and "max_total_num_tokens" in self.sglang.facts

    def _vllm(self, number: int, line: str) -> None:
        process = m.group(1) if (m := _VLLM_PROCESS.search(line)) else "engine"
        if m := _VLLM_KV.search(line):  # (0.32 prints the concurrency on the same line: read on below)
            self._new(number, "vllm", process).pool_tokens = _int(m.group(1))
        if m := _VLLM_CONCURRENCY.search(line):
            node = next((n for n in reversed(self.nodes) if n.source == "vllm" and n.label == process), None)
            node = node or self._new(number, "vllm", process)
            node.context_length, node.context_from = _int(m.group(1)), "Maximum concurrency line"
            node.concurrency = float(m.group(2))
        elif m := _VLLM_SEQ_LEN.search(line):
            self.vllm_context = int(m.group(1)), "engine config max_seq_len"
        elif (m := _VLLM_ARG.search(line)) and self.vllm_context is None:
            self.vllm_context = int(m.group(1)), "args max_model_len"
