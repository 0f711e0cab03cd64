"""Views of a rewrite for people: the graph around each site before and after, a diff, an HTML page.

Everything here works from plain data (``graph_views`` turns graphs into JSON-able dicts) so a
saved rewrite can be inspected later without re-running the passes.
"""

from __future__ import annotations

import difflib
import html
import logging
import shutil
from typing import Iterable, Optional

import torch
from torch.fx import GraphModule, Node

from pagedattn.report import COLUMNS, fmt_cell, site_table

log = logging.getLogger("pagedattn")

# how far to look for a skipped site's neighbourhood (it has no proven q/k/v)
_SKIPPED_RADIUS = 2


# ----------------------------------------------------------------------------- graph -> data


def graph_views(before: GraphModule, after: GraphModule, sites, paged_sites=()) -> dict:
    """The code of both graphs and, per site, the nodes around it in each (JSON-able)."""
    b_nodes = {n.name: n for n in before.graph.nodes}
    a_nodes = {n.name: n for n in after.graph.nodes}
    cores = _replacement_nodes(after, {p.cache_input: p.site for p in paged_sites})
    views = {}
    for s in sites:
        seeds = _seeds(s, b_nodes)
        core = cores.get(s.name)
        ends = _first_shared(core, b_nodes) if core is not None else \
            [u.name for u in b_nodes[s.anchor.name].users] if s.anchor.name in b_nodes else []
        views[s.name] = {
            "before": _describe(_region(b_nodes, seeds, ends)),
            "after": _describe(_region(a_nodes, seeds, ends, _cache_writes(core))),
        }
    return {"before_code": before.code.strip(), "after_code": after.code.strip(), "sites": views}


def _replacement_nodes(gm: GraphModule, cache_sites: dict[str, str]) -> dict[str, Node]:
    """Site name -> the node that now computes it (paged attention, or canonical attention left dense)."""
    out = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n.name in cache_sites:
            for u in n.users:
                if u.target is torch.ops.pagedattn.paged_attention.default:
                    out[cache_sites[n.name]] = u
        elif n.op == "call_function" and "pagedattn_site" in n.meta:
            out.setdefault(n.meta["pagedattn_site"], n)
    return out


def _cache_writes(core: Optional[Node]) -> list[Node]:
    """The KV-cache write that feeds a paged attention (it has no users, so no path reaches it)."""
    if core is None or core.target is not torch.ops.pagedattn.paged_attention.default:
        return []
    return [u for u in core.args[3].users if u.target is torch.ops.pagedattn.write_kv_cache.default]


def _seeds(site, nodes: dict[str, Node]) -> list[str]:
    """The site's proven inputs (q, k, v), or for a skipped site the softmax's own neighbourhood."""
    seeds = [n.name for n in (site.query, site.key, site.value) if n is not None and n.name in nodes]
    if seeds:
        return seeds
    frontier = [site.anchor]
    for _ in range(_SKIPPED_RADIUS):
        frontier = [a for n in frontier for a in n.all_input_nodes if a.op == "call_function"] or frontier
    return [n.name for n in frontier]


def _first_shared(core: Node, shared: dict[str, Node]) -> list[str]:
    """Walking down from ``core``, the first nodes that also exist in the other graph."""
    ends, todo, seen = [], list(core.users), set()
    while todo:
        n = todo.pop()
        if n in seen or n.op == "output":
            continue
        seen.add(n)
        if n.name in shared:
            ends.append(n.name)
        else:
            todo.extend(n.users)
    return ends or [core.name]


def _region(nodes: dict[str, Node], seeds: list[str], ends: list[str], also: Iterable[Node] = ()) -> list[Node]:
    """Nodes on some path from a seed to an end, with the seeds and ends themselves, in graph order."""
    starts = [nodes[n] for n in seeds if n in nodes]
    stops = [nodes[n] for n in ends if n in nodes] + list(also)
    down = _closure(starts, lambda n: n.users)
    up = _closure(stops, lambda n: n.all_input_nodes)
    keep = (down & up) | set(starts) | set(stops)
    order = {n: i for i, n in enumerate(nodes.values())}
    return sorted(keep, key=order.__getitem__)


def _closure(start: Iterable[Node], step) -> set[Node]:
    seen, todo = set(), list(start)
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        todo.extend(step(n))
    return seen


def _describe(region: list[Node]) -> list[dict]:
    inside = set(region)
    out = []
    for n in region:
        out.append({"name": n.name, "op": _target(n), "inputs": [a.name for a in n.all_input_nodes],
                    "line": _line(n), "region": True})
    extra = {a for n in region for a in n.all_input_nodes if a not in inside}
    for a in sorted(extra, key=lambda a: a.name):
        out.append({"name": a.name, "op": _target(a), "inputs": [], "line": _line(a), "region": False})
    return out


def _target(n: Node) -> str:
    if n.op == "call_function":
        if isinstance(n.target, torch._ops.OpOverload):
            return str(n.target).removesuffix(".default")
        return getattr(n.target, "__name__", str(n.target))
    return n.op if n.op != "get_attr" else f"get_attr {n.target}"


def _line(n: Node) -> str:
    args = ", ".join(_arg(a) for a in n.args)
    val = n.meta.get("val")
    shape = f"  # {str(val.dtype).replace('torch.', '')}{list(val.shape)}" if hasattr(val, "shape") else ""
    if n.op == "placeholder":
        return f"{n.name}: input{shape}"
    if n.op == "get_attr":
        return f"{n.name} = self.{n.target}{shape}"
    return f"{n.name} = {_target(n)}({args}){shape}"


def _arg(a) -> str:
    if isinstance(a, Node):
        return a.name
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_arg(x) for x in a)
        return f"[{inner}]"
    if isinstance(a, float):
        return f"{a:.6g}"
    return repr(a)


# ----------------------------------------------------------------------------- text


def code_diff(views: dict, context: int = 3) -> str:
    diff = difflib.unified_diff(views["before_code"].splitlines(), views["after_code"].splitlines(),
                                "before (exported graph)", "after (paged graph)", n=context, lineterm="")
    return "\n".join(diff)


def site_text(views: dict, name: str) -> str:
    v = views["sites"].get(name)
    if v is None:
        return f"(no graph recorded for site {name})"
    before = {d["name"] for d in v["before"] if d["region"]}
    after = {d["name"] for d in v["after"] if d["region"]}
    lines = [f"--- {name}: before"]
    lines += [("- " if d["name"] not in after else "  ") + d["line"] for d in v["before"] if d["region"]]
    lines += [f"+++ {name}: after"]
    lines += [("+ " if d["name"] not in before else "  ") + d["line"] for d in v["after"] if d["region"]]
    return "\n".join(lines)


def render_text(report: list[dict], views: Optional[dict], *, sites: Optional[list[str]] = None,
                diff: bool = True) -> str:
    parts = [site_table(report)]
    if views is None:
        return parts[0]
    for r in report:
        if sites and r["name"] not in sites:
            continue
        parts.append("")
        parts.append(site_text(views, r["name"]))
    if diff:
        parts += ["", "=== unified diff of the graph code", code_diff(views)]
    return "\n".join(parts)


# ----------------------------------------------------------------------------- HTML


def graphviz_missing() -> Optional[str]:
    """Why site drawings cannot be made here, or None when they can."""
    try:
        import pydot  # noqa: F401
    except ImportError:
        return "pydot is not installed (pip install pydot)"
    if shutil.which("dot") is None:
        return "Graphviz's `dot` program is not on PATH (apt install graphviz / brew install graphviz)"
    return None


def site_svg(nodes: list[dict], other: set[str], colour: str) -> str:
    """An SVG drawing of one side of a site; nodes absent from the other side are coloured."""
    import pydot

    g = pydot.Dot(graph_type="digraph", rankdir="TB", bgcolor="white", fontname="Helvetica")
    for d in nodes:
        style = dict(shape="box", style="rounded,filled", fillcolor="white", fontname="Helvetica", fontsize="10")
        if not d["region"]:
            style.update(shape="ellipse", fillcolor="#eeeeee", fontcolor="#555555")
        elif d["name"] not in other:
            style.update(fillcolor=colour)
        label = f"{d['op']}\\n{d['name']}" if d["region"] else d["name"]
        g.add_node(pydot.Node(_dot_id(d["name"]), label=label, **style))
    names = {d["name"] for d in nodes}
    for d in nodes:
        for a in d["inputs"]:
            if a in names:
                g.add_edge(pydot.Edge(_dot_id(a), _dot_id(d["name"])))
    svg = g.create_svg().decode()
    return svg[svg.index("<svg"):]  # drop the XML prolog so it can sit inline


def _dot_id(name: str) -> str:
    return '"' + name.replace('"', "") + '"'


_CSS = """
body { font-family: Helvetica, Arial, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; font-size: 13px; } td, th { border: 1px solid #ccc; padding: 3px 8px; }
th { background: #f3f3f3; } .rewritten { color: #186a1b; } .skipped { color: #a33; }
.pair { display: flex; gap: 2em; align-items: flex-start; } .pair > div { flex: 1; overflow-x: auto; }
pre { background: #f8f8f8; padding: .6em; font-size: 12px; overflow-x: auto; }
.add { color: #186a1b; } .del { color: #a33; } .note { background: #fff6d6; padding: .5em 1em; }
"""


def render_html(report: list[dict], views: Optional[dict], title: str = "pagedattn rewrite",
                summary: Optional[dict] = None) -> str:
    """One self-contained page: summary, site table, drawings of each site before/after, the diff."""
    e = html.escape
    out = [f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title)}</title><style>{_CSS}</style>"
           f"</head><body><h1>{e(title)}</h1>"]
    if summary:
        out.append("<table>" + "".join(f"<tr><th>{e(str(k))}</th><td>{e(str(v))}</td></tr>" for k, v in summary.items())
                   + "</table>")
    out.append("<h2>Attention sites</h2><table><tr>" + "".join(f"<th>{c}</th>" for c in COLUMNS) + "</tr>")
    for r in report:
        cells = "".join(f"<td>{e(fmt_cell(r.get(c)))}</td>" for c in COLUMNS)
        out.append(f"<tr class='{e(r['status'])}'>{cells}</tr>")
    out.append("</table>")
    if views is not None:
        why = graphviz_missing()
        if why:
            out.append(f"<p class='note'>Site drawings are left out: {e(why)}. The node listings below are complete.</p>")
        for r in report:
            v = views["sites"].get(r["name"])
            if v is None:
                continue
            out.append(f"<h2 id='{e(r['name'])}'>{e(r['name'])} <small class='{e(r['status'])}'>{e(r['status'])}"
                       f"{(': ' + e(r['reason'])) if r.get('reason') else ''}</small></h2><div class='pair'>")
            b_names = {d["name"] for d in v["before"] if d["region"]}
            a_names = {d["name"] for d in v["after"] if d["region"]}
            for side, nodes, other, colour in (("before", v["before"], a_names, "#f7c6c6"),
                                               ("after", v["after"], b_names, "#c9efc4")):
                out.append(f"<div><h3>{side}</h3>")
                if not why:
                    try:
                        out.append(site_svg(nodes, other, colour))
                    except Exception as ex:  # a drawing must never cost the page
                        out.append(f"<p class='note'>drawing failed: {e(str(ex).splitlines()[0] if str(ex) else '')}</p>")
                lines = "\n".join(d["line"] for d in nodes if d["region"])
                out.append(f"<pre>{e(lines)}</pre></div>")
            out.append("</div>")
        diff = code_diff(views).splitlines()
        out.append("<h2>Graph code diff</h2><pre>")
        for line in diff:
            cls = "add" if line.startswith("+") else "del" if line.startswith("-") else ""
            out.append(f"<span class='{cls}'>{e(line)}</span>" if cls else e(line))
        out.append("</pre>")
    out.append("</body></html>")
    return "\n".join(out)
