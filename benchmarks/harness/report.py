"""How the benchmarks print: lines as they happen, aligned tables of figures, and each figure
beside its target (``met`` / ``NOT MET``)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

MB = 1e6


def log(msg: str) -> None:
    print(msg, flush=True)


def fmt_mb(n: int | None) -> str:
    return "n/a" if n is None else f"{n / MB:,.2f}"


def fmt_ratio(num: float, den: float) -> str:
    return f"{num / den:.2f}x" if den else "n/a"


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[str(h) for h in headers], *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        print(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
        if n == 0:
            print("  ".join("-" * w for w in widths))
    sys.stdout.flush()


def met(ok: bool) -> str:
    return "met" if ok else "NOT MET"


def size_label(n: int) -> str:
    if n >= 1_000_000 and n % 1_000_000 == 0:
        return f"{n // 1_000_000}M"
    if n >= 1000 and n % 1000 == 0:
        return f"{n // 1000}k"
    return str(n)


def describe_steps(figures: dict[str, Any]) -> str:
    steps = [f"{k[5:]} {v:.1f} s" for k, v in figures.items() if k.startswith("step:")]
    inside = figures.get("seconds")
    return (
        f"steps: {', '.join(steps) or 'n/a'}; materialize() inside the asset: "
        f"{f'{inside:.1f} s' if isinstance(inside, int | float) else 'n/a'}"
    )


def timed(name: str, run: Callable[[], None]) -> None:
    t0 = time.perf_counter()
    run()
    log(f"  ({name}: {time.perf_counter() - t0:.0f} s in all)")
