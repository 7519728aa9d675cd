"""What each phase measured, the violations it found, and the one table the suite prints."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Idle:
    """/metrics once a phase is over: all zero within the deadline, or the last values seen."""

    running: float
    waiting: float
    kv_usage: float
    kv_blocks: int
    seconds: float  # until idle, or the deadline when it never got there
    reached: bool


@dataclass
class PhaseResult:
    name: str
    requests: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    resets: int = 0  # connections dropped under a request, or a keep-alive closed unannounced
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    idle: Idle | None = None
    seconds: float = 0.0
    # 503 is the designed answer to overload; elsewhere it counts as a server error.
    allow_503: bool = False

    def record(self, status: int) -> None:
        self.requests += 1
        self.statuses[status] += 1

    @property
    def server_errors(self) -> int:
        return sum(n for s, n in self.statuses.items()
                   if s >= 500 and not (s == 503 and self.allow_503))

    def fail(self, message: str, limit: int = 20) -> None:
        """Records a violation; past `limit` of them only their number grows."""
        if len(self.violations) < limit:
            self.violations.append(message)
        elif len(self.violations) == limit:
            self.violations.append("... (more violations not listed)")

    def all_violations(self) -> list[str]:
        found = list(self.violations)
        if self.server_errors:
            found.append(f"{self.server_errors} responses >= 500")
        if self.resets:
            found.append(f"{self.resets} connection resets")
        if self.idle is not None and not self.idle.reached:
            found.append(f"not idle {self.idle.seconds:.0f} s after the phase: running="
                         f"{self.idle.running:g} waiting={self.idle.waiting:g} "
                         f"kv_blocks={self.idle.kv_blocks}")
        return found


def _statuses(c: Counter[int]) -> str:
    return " ".join(f"{s}:{n}" for s, n in sorted(c.items())) or "-"


def _idle(i: Idle | None) -> str:
    if i is None:
        return "-"
    when = f"{i.seconds:.2f}s" if i.reached else f"NOT in {i.seconds:.0f}s"
    return f"{i.running:g}/{i.waiting:g}/{i.kv_blocks} ({when})"


def render_table(results: list[PhaseResult], footer: list[str]) -> str:
    header = ("phase", "requests", "statuses", "5xx", "resets", "run/wait/KV after",
              "time", "result")
    rows = [header]
    for r in results:
        rows.append((r.name, str(r.requests), _statuses(r.statuses), str(r.server_errors),
                     str(r.resets), _idle(r.idle), f"{r.seconds:.0f}s",
                     "FAIL" if r.all_violations() else "ok"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in results:
        for note in r.notes:
            lines.append(f"- {r.name}: {note}")
    lines += [f"- {line}" for line in footer]
    return "\n".join(lines)


def violations(results: list[PhaseResult]) -> list[str]:
    return [f"{r.name}: {v}" for r in results for v in r.all_violations()]
