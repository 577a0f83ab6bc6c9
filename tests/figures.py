"""The figures check: every measured figure a README quotes is the value a data file it names holds.

A figure is a number with a unit (us, ms, s, min, %, x, TFLOPS, GB/s, TB/s, GB, MiB, tokens/s, kernels, launches,
tests, passed, skipped) in the text of the project's README, of its history (docs/history.md) or of a README under
bench/results/. It must be held by a
data file its context names: the block it stands in (a list item, a paragraph, a table row), the list items above it,
the paragraph that leads into its list, for a table row the paragraph above the table, and the heading of its
section. A name is a path in
backticks: from the repository's root (``bench/results/...``, ``docs/perf/...``), from the README's own folder in a
results README (``run1_e12afa2/``, ``../rank_at_depth/README.md``, ``bench.log``), or a results file's stem
(``kernels_gemm_07ef67b``).

- A data file is any file under bench/results/ but a README.md; a folder stands for every data file under it. A
  results README's figures may also be held by its own folder's data files, which it describes.
- A README (a results README, or a docs/perf page) is never the data of a figure: naming it stands for the data
  files it names itself (and, through the READMEs it names, theirs). So a figure a README quotes from another is
  held only when that README names the file that holds it.
- Held means the same number in the data file's units, with the figure's own rounding: a JSON value's unit is
  that of its key (``us``, ``kernel_ms_per_step``, ``pct_copy``, ``x_vs_bf16``, ``copy_bandwidth_gbs``, ...; a
  key without one, a kernel's name, takes its parent's; a list of samples stands for its median, least and most),
  a table cell's that of its column's header, a number in
  text that of the unit written after it or of the ``name=`` / ``name:`` before it. A number with no unit holds no
  figure, and a unit converts only to its own kind (us / ms / s / min; GB/s / TB/s; MiB / GiB); the figure is the
  value rounded to the figure's decimals.
- Targets, goals, bounds and approximations ("target 70 %", "<= 5.0 ms", "N > 1024", "about 10 %", "~12 us")
  are not figures, nor are an issue's own figures quoted in a table column whose header names the issue, nor are
  the figures :data:`DERIVED` lists for a README with how it derives them.

So a figure edited without its file, a figure with no file named, a named file that was removed, and a figure a
README copies from another README that does not name its data all fail.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import statistics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "bench", "results")

UNITS = r"(?:us|ms|s|min|%|x|TFLOPS|GB/s|TB/s|GB|MiB|tokens/s|kernels|launches|tests|passed|skipped)"
NUMBER = r"\d+(?:[ ,]\d{3})*(?:\.\d+)?"
JOIN = r"\s*(?:->|-|/|to|against|and|or|,)\s*"  # figures sharing one unit: "1.21-1.79x", "14.5 against 14.2 ms"
FIGURE = re.compile(rf"(?<![\w.=<>/^-])((?:{NUMBER}{JOIN})*{NUMBER})\s?({UNITS})(?![\w/])(?<!x(?=\s\d))")
NOT_A_FIGURE = re.compile(r"(?:(?:target|goal)(?: of)?|<=|>=|<|>|~|about|at least|at most|issue)[ :,]*$", re.I)
# Figures a README derives in its own text, each with how (not measurements, so no data file holds them), by README.
DERIVED = {
    "README.md": {
        "7.5 MiB": "2 blocks x 64 rows x (656 + 132) bytes x 78 layers: the scratch cache's size",
        "12 KB": "a row's hidden state, 6144 bf16 values: the all-reduce's payload",
        "38 KB": "a rank's 19 395 logits of 154 880 / 8 in bf16: the all-gather's payload",
    },
    "docs/history.md": {
        "2.997 x": "206.99 / 69.066 ms, eager over fxglm5 in compile_backend.json (which rounds it to 3.0)",
        "1.51 x": "26294.5 / 17373 tokens/s, accept-all over plain in decode_host_speculative_2d7f52e/"
                  "speculative_k3_ctx2048_B64_2d7f52e.json",
    },
    "bench/results/kernel_goals_ncu_17c1af7/README.md": {
        "274 passed": "200 + 36 + 19 + 19, the four logs' counts (gpu_fp8, gpu_attention, gpu_g3, gpu_g4_17c1af7.log)",
    },
    "bench/results/long_workload_h100_c3d9c51/README.md": {
        "80 GB": "the H100's memory, in its product name (NVIDIA H100 80GB HBM3): no measurement",
    },
    "bench/results/decode_host_speculative_2d7f52e/README.md": {
        "1.51 x": "26294.5 / 17373 tokens/s, accept-all over plain in speculative_k3_ctx2048_B64_2d7f52e.json",
    },
}

# ---- units ------------------------------------------------------------------------------------------------------
# A unit's kind and its size in the kind's base unit: a figure is held by a value of its own kind only.
SCALE = {"us": ("time", 1e-6), "ms": ("time", 1e-3), "s": ("time", 1.0), "min": ("time", 60.0),
         "%": ("%", 1.0), "x": ("x", 1.0), "TFLOPS": ("TFLOPS", 1.0), "GB/s": ("bw", 1.0), "TB/s": ("bw", 1000.0),
         "GB": ("GB", 1.0), "MiB": ("bytes", 1.0), "GiB": ("bytes", 1024.0), "tokens/s": ("tokens/s", 1.0),
         "count": ("count", 1.0), "fraction": ("%", 100.0)}
FIGURE_UNIT = {"kernels": "count", "launches": "count", "tests": "count", "passed": "count", "skipped": "count"}
# A key's (or a header's, or the word before a number's) words that name a unit. "min" is not one: in keys it is
# the minimum ("ms_min"), a load average's window ("load_avg_1_5_15_min").
WORD_UNIT = {"us": "us", "ms": "ms", "s": "s", "sec": "s", "secs": "s", "second": "s", "seconds": "s",
             "minutes": "min", "pct": "%", "percent": "%", "%": "%", "tflops": "TFLOPS", "gbs": "GB/s",
             "gb/s": "GB/s", "tbps": "TB/s", "tb/s": "TB/s", "gb": "GB", "gib": "GiB", "mib": "MiB", "x": "x",
             "speedup": "x", "ratio": "x", "over": "x", "kernels": "count", "launches": "count", "calls": "count",
             "count": "count", "passed": "count", "skipped": "count", "failed": "count", "tests": "count",
             "rel": "fraction", "fraction": "fraction"}
# written after a number in a data file's text ("4677.1 us", "82.3 %", "2.17x", "1013 passed")
TEXT_UNIT = re.compile(r"\s?(us|ms|s|min|%|x|TFLOPS|GB/s|TB/s|GB|GiB|MiB|tokens/s|kernels|launches|calls|tests|"
                       r"passed|skipped)(?![\w/])")
VALUE = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def key_unit(key) -> str | None:
    """The unit a JSON key, a table header or a ``name=`` names: its first word that is one, a measure before a
    count ("tokens_per_s" is tokens/s, "kernel_ms_per_step" ms, "kernels_us_per_step" us, "kernels_per_step" a
    count, "x_vs_bf16" x, "wall_over_kernel" x)."""
    if not isinstance(key, str):
        return None
    low = key.strip().lower()
    if re.search(r"(?:^|[^a-z])per_s(?:$|[^a-z])|tokens/s", low):
        return "tokens/s"
    if low in WORD_UNIT:
        return WORD_UNIT[low]
    units = [WORD_UNIT[w] for w in re.split(r"[\s_\-.:,;()<>\[\]{}'\"=*|]+", low) if w in WORD_UNIT]  # whole words:
    measures = [u for u in units if u != "count"]  # a kernel's "256x64" names no unit; "kernels_us_per_step" is us
    return (measures or units or [None])[0]


@dataclasses.dataclass(frozen=True)
class Value:
    number: float
    unit: str


@functools.lru_cache(maxsize=None)
def values(path: str) -> tuple[Value, ...]:
    """Every number of data file ``path`` that has a unit, in that unit."""
    with open(path, errors="replace") as f:
        text = f.read()
    if path.endswith(".json"):
        try:
            return tuple(_json_values(json.loads(text), None))
        except ValueError:
            pass
    return tuple(_text_values(text))


def _json_values(node, unit):
    if isinstance(node, dict):
        for key, value in node.items():
            own = key_unit(key)
            if own == "count" and isinstance(value, (dict, list)):
                own = None  # "kernels": {name: time}: a count names its numbers, not a table's
            yield from _json_values(value, own or unit)
    elif isinstance(node, list):
        if len(node) > 2 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in node):
            if unit is not None:  # a run's samples (each step's time): a figure quotes their median, least or most
                yield from (Value(float(v), unit) for v in (statistics.median(node), min(node), max(node)))
            return
        for value in node:
            yield from _json_values(value, unit)
    elif isinstance(node, bool):
        return
    elif isinstance(node, (int, float)):
        if unit is not None:
            yield Value(float(node), unit)
    elif isinstance(node, str):
        yield from _text_values(node)


def _text_values(text: str):
    header: list[str | None] = []
    for line in text.splitlines():
        cells = line.strip().strip("|").split("|") if line.lstrip().startswith("|") else None
        if cells is not None and not re.fullmatch(r"[\s|:-]*", line):
            if not header or not any(VALUE.search(c) for c in cells):
                header = [key_unit(c) for c in cells]  # a table's first row: its columns' units
                continue
            for cell, unit in zip(cells, header + [None] * len(cells)):
                yield from _numbers(cell, unit)
            continue
        if cells is None:
            header = []
            yield from _numbers(line, None)


def _numbers(text: str, unit: str | None):
    """The numbers of ``text`` with their unit: written after the number, else the ``name=`` / ``name:`` before it,
    else ``unit`` (a table column's)."""
    for match in VALUE.finditer(text):
        after = TEXT_UNIT.match(text, match.end())
        named = re.search(r"([\w/%]+)['\"]?\s*[=:]\s*$", text[:match.start()])
        found = WORD_UNIT.get(after.group(1).lower(), after.group(1)) if after else (
            key_unit(named.group(1)) if named else unit)
        if found in SCALE:
            yield Value(float(match.group()), found)


def held(files: list[str], figure: str, unit: str) -> bool:
    """Whether one of ``files`` holds ``figure`` (a number as written) in ``unit``: a value of the unit's kind that,
    converted, rounds to it at its decimals."""
    kind, size = SCALE[FIGURE_UNIT.get(unit, unit)]
    number = float(figure.replace(" ", "").replace(",", ""))
    places = len(figure.split(".")[1]) if "." in figure else 0
    tolerance = 0.5 * 10 ** -places * (1 + 1e-9) + 1e-12
    for path in files:
        for v in values(path):
            their_kind, their_size = SCALE[v.unit]
            if their_kind == kind and abs(v.number * their_size / size - number) <= tolerance:
                return True
    return False


# ---- names ------------------------------------------------------------------------------------------------------
def is_readme(path: str) -> bool:
    return os.path.basename(path) == "README.md" or path.startswith(os.path.join(REPO, "docs", "perf") + os.sep)


@functools.lru_cache(maxsize=None)
def data_files() -> tuple[str, ...]:
    return tuple(sorted(p for p in _walk(RESULTS) if not is_readme(p)))


def _walk(folder: str):
    for root, _, names in os.walk(folder):
        yield from (os.path.join(root, n) for n in names)


def own_folder(where: str) -> list[str]:
    """A results README's own folder's data files: what its figures are held by besides the files it names (the
    project's README has none)."""
    if not where.startswith(RESULTS + os.sep):
        return []
    return [p for p in data_files() if p.startswith(where + os.sep)]


def named_files(text: str, where: str) -> tuple[list[str], list[str]]:
    """(the data files ``text`` names, the names that look like results files but resolve to nothing); ``where``:
    the folder of the README the text is in (its relative names resolve there)."""
    files, missing = [], []
    for name in re.findall(r"`([^`\s]+)`", text):
        name = name.rstrip(",;:.")
        found = resolve(name, where)
        if found is None:
            continue
        if found == []:
            missing.append(name)
        files += found
    return files, missing


def resolve(name: str, where: str) -> list[str] | None:
    """The data files ``name`` stands for ([] for a results-like name that is nowhere; None for a name that is no
    results name at all)."""
    rooted = name.startswith(("bench/results", "docs/perf/"))
    if re.search(r"\.\{[\w,]+\}$", name):  # name.{json,log}: each of the files
        base, exts = re.match(r"(.*)\.\{([\w,]+)\}$", name).groups()
        parts = [resolve(f"{base}.{ext}", where) for ext in exts.split(",")]
        return None if all(p is None for p in parts) else [f for p in parts for f in (p or [])]
    relative = not rooted and where.startswith(RESULTS) and re.fullmatch(r"(\.\./)*[\w\-./]+", name) and (
        "/" in name or "." in name)
    if rooted or relative:
        path = os.path.normpath(os.path.join(REPO if rooted else where, name))
        if os.path.isdir(path):
            return [p for p in data_files() if p.startswith(path.rstrip("/") + os.sep)]
        if os.path.isfile(path):
            return readme_sources(path) if is_readme(path) else [path] if path in data_files() else None
        if rooted:
            return []
    stem = re.sub(r"\.(\{[\w,]+\}|json|md|log|txt)$", "", name)
    if not re.fullmatch(r"[\w\-/]+", stem) or stem.split("/")[-1] == "README":
        return None
    found = [p for p in data_files() if os.path.relpath(p, RESULTS).startswith(stem + ".")
             or os.path.basename(p).split(".")[0] == stem.split("/")[-1]]
    if found:
        return found
    return [] if stem != name or re.search(r"_(s\d+|[0-9a-f]{7})$", stem) else None


@functools.lru_cache(maxsize=None)
def readme_sources(path: str, seen: frozenset = frozenset()) -> list[str]:
    """The data files a README (or docs/perf page) names, and through the READMEs it names, theirs."""
    if path in seen:
        return []
    with open(path) as f:
        text = f.read()
    files = []
    for name in re.findall(r"`([^`\s]+)`", text):
        name = name.rstrip(",;:.")
        rooted = name.startswith(("bench/results", "docs/perf/"))
        target = os.path.normpath(os.path.join(REPO if rooted else os.path.dirname(path), name))
        if os.path.isfile(target) and is_readme(target):
            files += readme_sources(target, seen | {path})
        else:
            files += resolve(name, os.path.dirname(path)) or []
    return sorted(set(files))


# ---- the README's blocks ------------------------------------------------------------------------------------------
def doc_blocks(text: str):
    """(kind, nesting, text, line) of each list item, paragraph, table row and heading outside code blocks."""
    blocks, current, fence = [], None, False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fence, current = not fence, None
            continue
        if fence or not line.strip():
            current = None
            continue
        item = re.match(r"^(\s*)(?:[-*]|\d+\.)\s+(.*)", line)
        if item:
            current = ["item", len(item.group(1)) // 2, item.group(2), number]
            blocks.append(current)
        elif line.startswith("    ") and current is None:
            continue  # an indented code block
        elif line.lstrip().startswith(("|", "#")):
            blocks.append(["row" if line.lstrip().startswith("|") else "heading", 0, line, number])
            current = None
        elif current is None:
            current = ["paragraph", 0, line, number]
            blocks.append(current)
        else:
            current[2] += " " + line.strip()
    return blocks


def figures(body: str, derived=frozenset()) -> list[tuple[str, str, int]]:
    """(number as written, unit, offset) of each figure in a block's text (targets and goals, and the figures
    ``derived`` names, left out)."""
    out = []
    for match in FIGURE.finditer(body):
        if NOT_A_FIGURE.search(body[max(0, match.start() - 12):match.start()]):
            continue  # "about 0.3-4.5 us": the whole run
        for part in re.finditer(rf"{NUMBER}", match.group(1)):
            at = match.start(1) + part.start()
            if not NOT_A_FIGURE.search(body[max(0, at - 12):at]):  # "N > 1024, 852-1253 TFLOPS": the one number
                out.append((part.group(), match.group(2), at))
    return [f for f in out if f"{f[0]} {f[1]}" not in derived]


@dataclasses.dataclass(frozen=True)
class Claim:
    """A figure of a README: where it stands, what it says, and the data files its context names."""

    line: int
    offset: int  # in its block's text
    number: str  # as written
    unit: str
    files: tuple[str, ...]


def claims(text: str, where: str = REPO, name: str = "README.md") -> tuple[list[Claim], list[str]]:
    """Every figure of ``text`` (a README in folder ``where``, ``name`` in that folder) with the data files that may
    hold it, and the names its blocks give that resolve to nothing (one line each)."""
    out, missing, parents, paragraph, section, header, last = [], [], [], "", "", [], None
    derived = DERIVED.get(os.path.relpath(os.path.join(where, name), REPO), {})
    for kind, depth, body, line in doc_blocks(text):
        if kind == "row":
            cells = body.strip().strip("|").split("|")
            if last != line - 1:  # a table's first row: its header
                header, last = cells, line
                continue
            last = line
            body = "|".join("" if "issue" in h.lower() else c for c, h in zip(cells, header + [""] * len(cells)))
        if kind == "heading":
            parents, paragraph, section = [], "", body
            context = body
        elif kind == "item":
            parents = [p for p in parents if p[0] < depth] + [(depth, body)]
            context = " ".join([section, paragraph, *(p[1] for p in parents)])
        elif kind == "paragraph":
            parents, paragraph = [], body
            context = section + " " + body
        else:
            context = section + " " + paragraph + " " + body
        found = figures(body, derived)
        if not found:
            continue
        files, gone = named_files(context, where)
        missing += [f"line {line}: names {name}, which is not in bench/results" for name in gone]
        files = tuple(files + own_folder(where))
        out += [Claim(line, at, number, unit, files) for number, unit, at in found]
    return out, missing


def figure_problems(text: str, where: str = REPO, name: str = "README.md") -> list[str]:
    """What of ``text`` (a README in folder ``where``, ``name`` in that folder) breaks the rule above: one line per
    figure or name, with its line number."""
    found, problems = claims(text, where, name)
    for claim in found:
        if not claim.files:
            problems.append(f"line {claim.line}: {claim.number} {claim.unit} with no data file named")
        elif not held(list(claim.files), claim.number, claim.unit):
            names = sorted({os.path.relpath(p, REPO) for p in claim.files})
            problems.append(f"line {claim.line}: {claim.number} {claim.unit} is in none of "
                            f"{names[:4]}{' ...' if len(names) > 4 else ''}")
    return sorted(set(problems), key=lambda p: (int(p.split(":")[0].split()[1]), p))


def readmes() -> list[str]:
    """The README, its history and every README under bench/results/."""
    return [os.path.join(REPO, "README.md"), os.path.join(REPO, "docs", "history.md")] + sorted(
        p for p in _walk(RESULTS) if os.path.basename(p) == "README.md")


def problems_of(path: str, text: str | None = None) -> list[str]:
    if text is None:
        with open(path) as f:
            text = f.read()
    return figure_problems(text, os.path.dirname(path), os.path.basename(path))
