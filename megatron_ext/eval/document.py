"""A report as a list of blocks, rendered twice: Markdown (figures as PNG files next to it) and one static,
self-contained HTML page (figures embedded as base64 PNG, inline CSS, no scripts, nothing fetched)."""

from __future__ import annotations

import base64
import html
import os
import re
from dataclasses import dataclass, field

from megatron_ext.atomic import atomic_output

CSS = """body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;
color:#222}table{border-collapse:collapse;margin:0.8em 0;font-size:0.9em}th,td{border:1px solid #ccc;
padding:0.25em 0.6em;text-align:right}th{background:#f3f3f3}td.text,th.text{text-align:left}
img{max-width:100%;border:1px solid #eee;margin:0.5em 0}figure{margin:1em 0}figcaption{font-size:0.85em;color:#555}
code{background:#f6f6f6;padding:0 0.2em}"""


NUMERIC = re.compile(r"^(-|[-+]?[\d,]*\.?\d+%?|\[[-\d., ]+\])$")


def numeric_columns(header: list, rows: list) -> list[bool]:
    """Columns whose every cell is a number, '-' or an interval (right-aligned); the first column never is."""
    return [i > 0 and all(NUMERIC.match(str(row[i]).strip()) for row in rows) for i in range(len(header))]


@dataclass
class Document:
    title: str
    blocks: list = field(default_factory=list)

    def heading(self, text: str):
        self.blocks.append(("h2", text))

    def paragraph(self, text: str):
        self.blocks.append(("p", text))

    def table(self, header: list, rows: list):
        self.blocks.append(("table", header, rows))

    def figure(self, name: str, png: bytes, caption: str):
        self.blocks.append(("figure", name, png, caption))

    def markdown(self, figure_dir: str) -> str:
        out = [f"# {self.title}", ""]
        for block in self.blocks:
            if block[0] == "h2":
                out += [f"## {block[1]}", ""]
            elif block[0] == "p":
                out += [block[1], ""]
            elif block[0] == "table":
                header, rows = block[1], block[2]
                out.append("| " + " | ".join(map(str, header)) + " |")
                out.append("|" + "|".join("---:" if n else "---" for n in numeric_columns(header, rows)) + "|")
                out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
                out.append("")
            else:
                out += [f"![{block[3]}]({figure_dir}/{block[1]}.png)", "", f"*{block[3]}*", ""]
        return "\n".join(out)

    def html(self) -> str:
        out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
               f"<title>{html.escape(self.title)}</title><style>{CSS}</style></head><body>",
               f"<h1>{html.escape(self.title)}</h1>"]
        for block in self.blocks:
            if block[0] == "h2":
                out.append(f"<h2>{html.escape(block[1])}</h2>")
            elif block[0] == "p":
                out.append(f"<p>{html.escape(block[1])}</p>")
            elif block[0] == "table":
                numeric = numeric_columns(block[1], block[2])
                out.append("<table><thead><tr>" + "".join(f'<th{"" if n else " class=text"}>{html.escape(str(c))}</th>'
                                                          for c, n in zip(block[1], numeric)) + "</tr></thead><tbody>")
                out += ["<tr>" + "".join(f'<td{"" if n else " class=text"}>{html.escape(str(c))}</td>'
                                         for c, n in zip(row, numeric)) + "</tr>" for row in block[2]]
                out.append("</tbody></table>")
            else:
                data = base64.b64encode(block[2]).decode()
                out.append(f'<figure><img id="fig-{html.escape(block[1])}" alt="{html.escape(block[3])}" '
                           f'src="data:image/png;base64,{data}"><figcaption>{html.escape(block[3])}</figcaption>'
                           "</figure>")
        out.append("</body></html>")
        return "\n".join(out)

    def write(self, folder: str, stem: str) -> list[str]:
        """folder/STEM.md, folder/STEM.html and folder/STEM_figures/*.png; returns the paths written."""
        figure_dir = f"{stem}_figures"
        written = []
        for block in self.blocks:
            if block[0] == "figure":
                path = os.path.join(folder, figure_dir, f"{block[1]}.png")
                with atomic_output(path, "wb") as f:
                    f.write(block[2])
                written.append(path)
        for suffix, text in ((".md", self.markdown(figure_dir)), (".html", self.html())):
            path = os.path.join(folder, stem + suffix)
            with atomic_output(path) as f:
                f.write(text)
            written.append(path)
        return written


def fmt(value, digits: int = 3) -> str:
    """A table cell: '-' for missing, integers plain, floats rounded."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer() and abs(value) >= 100):
        return f"{int(value):,}"
    if isinstance(value, float):
        return f"{value:,.{digits}f}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def interval(ci) -> str:
    return "-" if not ci else f"[{ci[0]:.3f}, {ci[1]:.3f}]"
