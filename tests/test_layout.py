"""The engine's layout as docs/layout.md describes it: rooms by concern, arrows one way.

Read from the source with `ast`, so a new module or import that breaks the shape fails here."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENGINE = ROOT / "engine"

# A room may import from rooms of its own tier or below, never above.
TIERS = {
    "config": 0,
    "trace": 0,
    "errors": 0,
    "host_reads": 0,
    "checkpoint": 1,
    "experts": 2,
    "routing": 2,
    "adapters": 2,
    "runtime": 3,
    "train": 4,
    "measure": 4,
}
# What the app may import from the engine: the surface in engine/__init__.py, and the entry
# points of the measuring and training commands.
APP_MAY_IMPORT = ("engine", "engine.measure.", "engine.train.")


def modules_of(package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every module of a top-level package."""
    modules = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def engine_modules() -> dict[str, Path]:
    return modules_of("engine")


def imports(path: Path, module: str) -> list[tuple[str, list[str]]]:
    """(imported module, names) for every import in a file, relative ones made absolute."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found.append((base, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
    return found


def room(module: str) -> str:
    return module.split(".")[1] if module.count(".") >= 1 else ""


def test_every_engine_module_lives_in_a_known_room():
    for module in engine_modules():
        if module != "engine":
            assert room(module) in TIERS, f"{module} is outside the rooms of docs/layout.md"


def test_imports_point_down_the_rooms():
    wrong = []
    for module, path in engine_modules().items():
        if module == "engine":
            continue
        for target, _ in imports(path, module):
            if target.startswith("engine.") and room(target) in TIERS:
                if TIERS[room(target)] > TIERS[room(module)]:
                    wrong.append(f"{module} imports {target}")
    assert wrong == []


def room_imports(modules: dict[str, Path]) -> dict[tuple[str, str], list[str]]:
    """(room, other room) -> the imports that make the arrow, "module imports target", for every
    import from one room of the engine into another."""
    arrows: dict[tuple[str, str], list[str]] = {}
    for module, path in modules.items():
        for target, _ in imports(path, module):
            if module == "engine" or not target.startswith("engine."):
                continue
            if room(target) != room(module) and room(target) in TIERS:
                arrows.setdefault((room(module), room(target)), []).append(
                    f"{module} imports {target}"
                )
    return arrows


def same_tier_cycles(arrows, tiers: dict[str, int]) -> list[list[str]]:
    """The rooms of one tier that import each other, directly or round a loop: each strongly
    connected group of two or more rooms in the graph of same-tier arrows (Tarjan), sorted."""
    graph: dict[str, list[str]] = {}
    for a, b in arrows:
        if a != b and tiers.get(a) is not None and tiers.get(a) == tiers.get(b):
            graph.setdefault(a, []).append(b)
            graph.setdefault(b, [])
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups = []

    def visit(node: str) -> None:
        order[node] = low[node] = len(order)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in order:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], order[nxt])
        if low[node] == order[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in order:
            visit(node)
    return sorted(groups)


def test_rooms_of_one_tier_import_each_other_one_way():
    """Rooms of a tier may import each other (measure reads train's data), but never both ways,
    nor round a loop (experts -> routing -> adapters -> experts): a cycle makes the tier one room."""
    arrows = room_imports(engine_modules())
    wrong = [
        f"{' <-> '.join(group)}: "
        + "; ".join(
            line for (a, b), lines in arrows.items() if {a, b} <= set(group) for line in lines
        )
        for group in same_tier_cycles(arrows, TIERS)
    ]
    assert wrong == []


def test_same_tier_cycles_finds_the_loops_of_a_made_up_graph():
    tiers = {"base": 0, "a": 1, "b": 1, "c": 1, "d": 1, "top": 2}
    one_way = {("a", "b"): [], ("b", "c"): [], ("a", "base"): [], ("top", "a"): []}
    assert same_tier_cycles(one_way, tiers) == []
    both_ways = {**one_way, ("c", "b"): []}
    assert same_tier_cycles(both_ways, tiers) == [["b", "c"]]
    loop = {**one_way, ("c", "d"): [], ("d", "a"): []}
    assert same_tier_cycles(loop, tiers) == [["a", "b", "c", "d"]]
    # Across tiers is not a same-tier cycle (an upward arrow fails test_imports_point_down_the_rooms).
    assert same_tier_cycles({("a", "top"): [], ("top", "a"): []}, tiers) == []


def test_a_planted_cycle_fails_the_layout(tmp_path, monkeypatch):
    """A module of train planted to import measure (which imports train): the check sees the
    cycle and names the import that closes it."""
    modules = dict(engine_modules())
    planted = tmp_path / "planted.py"
    planted.write_text("from ..measure import evaluate\n")
    modules["engine.train.planted"] = planted
    arrows = room_imports(modules)
    assert same_tier_cycles(arrows, TIERS) == [["measure", "train"]]
    assert "engine.train.planted imports engine.measure" in arrows[("train", "measure")]


def test_no_engine_module_imports_a_private_name_of_another():
    wrong = []
    for module, path in engine_modules().items():
        for target, names in imports(path, module):
            private = [n for n in names if n.startswith("_") and n != "__future__"]
            if target.startswith("engine") and private:
                wrong.append(f"{module} imports {', '.join(private)} from {target}")
    assert wrong == []


def test_rich_only_in_training_and_measuring():
    wrong = [
        module
        for module, path in engine_modules().items()
        if room(module) not in ("train", "measure")
        and any(t.split(".")[0] == "rich" for t, _ in imports(path, module))
    ]
    assert wrong == []


def test_the_app_uses_the_engine_surface_and_entry_points_only():
    wrong = []
    for module, path in modules_of("edge0_tui").items():
        for target, _ in imports(path, module):
            if target.split(".")[0] == "mlx":
                wrong.append(f"{path.name} imports {target}")
            if target.startswith("engine") and not (
                target == "engine" or target.startswith(APP_MAY_IMPORT[1:])
            ):
                wrong.append(f"{path.name} imports {target}")
    assert wrong == []


def test_the_surface_names_resolve():
    import engine

    for name in engine.__all__:
        assert getattr(engine, name) is not None


def test_the_layout_page_lists_every_engine_module():
    """docs/layout.md names every package and module under engine/, and nothing that is not
    there; the README points to it."""
    assert "docs/layout.md" in (ROOT / "README.md").read_text()
    layout = (ROOT / "docs" / "layout.md").read_text()
    listed = set()
    package = None
    for line in layout.splitlines():
        m = re.match(r"^  (\w+)/\s", line)
        if m:
            package = m.group(1)
            listed.add(f"engine.{package}")
            continue
        m = re.match(r"^    (\w+)\.py\s", line)
        if m and package:
            listed.add(f"engine.{package}.{m.group(1)}")
            continue
        m = re.match(r"^  (\w+)\.py\s", line)
        if m:
            package = None
            listed.add("engine" if m.group(1) == "__init__" else f"engine.{m.group(1)}")
    modules = set(engine_modules())
    assert sorted(modules - listed) == [], "modules missing from docs/layout.md"
    assert sorted(listed - modules) == [], "docs/layout.md lists modules that do not exist"


# A figure with a unit (a time, a size, a share, a ratio, a rate) in a comment or a docstring:
# measured figures belong in docs/notebook/, dated, with their command; the comment keeps the
# reason. Text in backticks (an example of an option's syntax) is not a figure.
FIGURE = re.compile(
    r"(?<![\w.])\d[\d,]*(?:\.\d+)?"
    r"(?:x(?!\w)|\s?(?:ms|µs|us|s|KiB|MiB|GiB|kB|KB|MB|GB|TB|%|tok/s|MiB/s|GiB/s|MB/s|GB/s)(?![\w/]))"
)
# The few that are definitions, not measurements: (file, the text of the line, stripped).
FIGURE_DEFINITIONS = {
    # glibc's documented upper bound of its dynamic mmap threshold
    (
        "engine/experts/freed_memory.py",
        "threshold to the size of each such block freed (up to 32 MiB): after the first expert-sized",
    ),
    # a size computed from the arrays' shapes
    (
        "engine/experts/heat.py",
        "step): three uint8/bool arrays of layers x experts, 144 KB for 94 layers of 512 experts.",
    ),
    # the format of /proc/self/status
    ("engine/runtime/metrics.py", '# "VmHWM:  123456 kB"'),
    # the demo's size budget, computed from its shapes, and its held-out share (a setting)
    (
        "engine/train/base.py",
        "#   -> 24.25 M * 0.5625 B = 13.6 MB, routers (6 * 32 * 256, 8-bit) 0.05 MB, norms ~0.02 MB:",
    ),
    (
        "engine/train/base.py",
        "#   ~13.7 MB, leaving ~26 MB of the 40 MB assets budget for 3 prerouter + 3 LoRA files.",
    ),
    (
        "engine/train/base.py",
        "1. Data: Shakespeare's works (engine/corpus.py), 5% of the works held out; a byte-level BPE trained",
    ),
    # the shard size synth writes, as mlx-lm's convert does
    (
        "engine/train/synth.py",
        "- ``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` shards (<= 2 GiB each)",
    ),
    # a file format's size, computed
    (
        "engine/train/teacher_targets.py",
        "That is `k * 6 + 4` bytes a position, whatever the vocabulary: 388 bytes at k=64 (388 KB per 1k",
    ),
    (
        "engine/train/teacher_targets.py",
        "tokens), where a whole distribution over a 151k vocabulary in float32 is 604 KB per token. The",
    ),
    # what the strip looks like
    (
        "edge0_tui/widgets/wall_strip.py",
        "12.4 tok/s │ blocked 33 ms (41%) │ cold 29% │ 3.2 loads/step │ MLX 21 MiB",
    ),
}


def _comments_and_docstrings(path: Path) -> list[str]:
    source = path.read_text()
    lines = [
        token.string
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                lines.extend(doc.splitlines())
    return lines


def test_no_measured_figure_in_a_comment_or_docstring():
    """Comments say why, without measured figures: a time, a size, a share or a ratio in a
    comment or docstring of engine/ or edge0_tui/ fails here, but for the few definitions
    allow-listed above."""
    found, allowed = [], set()
    for root in ("engine", "edge0_tui"):
        for path in sorted((ROOT / root).rglob("*.py")):
            name = str(path.relative_to(ROOT))
            for line in _comments_and_docstrings(path):
                text = line.strip()
                if not FIGURE.search(re.sub(r"`[^`]*`", "", text)):
                    continue
                if (name, text) in FIGURE_DEFINITIONS:
                    allowed.add((name, text))
                else:
                    found.append(f"{name}: {text}")
    assert found == []
    assert len(FIGURE_DEFINITIONS) <= 10
    assert allowed == FIGURE_DEFINITIONS  # an entry no line needs any more is taken out


def runtime_imports(path: Path, module: str) -> set[str]:
    """The modules of this repository a file imports when it runs (at the top or inside a
    function), `from X import name` counting module X.name where that is a module; imports
    under `if TYPE_CHECKING:` are annotations, not imports, and are left out."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found.update(f"{base}.{alias.name}" for alias in node.names)
            found.add(base)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def module_cycles(package: str) -> list[list[str]]:
    """The modules of `package` that import each other, directly or round a loop."""
    modules = modules_of(package)
    graph = {}
    for module, path in modules.items():
        # Importing a.b.c runs a/__init__ and a/b/__init__ first: their imports count too.
        imported = runtime_imports(path, module)
        named = {".".join(m.split(".")[:n]) for m in imported for n in range(1, m.count(".") + 2)}
        named &= set(modules)
        # (a module's own packages are already running when it is imported)
        graph[module] = {m for m in named if m != module and not module.startswith(m + ".")}
    arrows = {(a, b): [] for a, targets in graph.items() for b in targets}
    return same_tier_cycles(arrows, dict.fromkeys(modules, 0))


def test_no_module_imports_another_that_imports_it_back():
    """Inside engine/ and edge0_tui/ no two modules import each other, even round a loop or
    inside a function (a lazy import hides a cycle, it does not remove it)."""
    assert module_cycles("engine") == []
    assert module_cycles("edge0_tui") == []
