"""Human-readable views of a rewrite report, and of an error in one line."""

from __future__ import annotations

COLUMNS = ("name", "status", "num_heads", "num_kv_heads", "head_dim", "scale", "mask", "window", "softcap", "alibi", "sinks",
           "key_padding", "reason")


def site_table(report: list[dict]) -> str:
    cols = COLUMNS
    rows = [[fmt_cell(r.get(c)) for c in cols] for r in report]
    widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c) for i, c in enumerate(cols)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    out = [line(cols), line(["-" * w for w in widths])] + [line(r) for r in rows]
    n_rw = sum(r["status"] == "rewritten" for r in report)
    out.append(f"{n_rw} of {len(report)} sites rewritten")
    return "\n".join(out)


def fmt_cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def first_line(e: BaseException) -> str:
    """An error's message in one line: its first (the type's name where it has none)."""
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__
