"""The engine's layout as the README describes it: rooms by concern, arrows one way.

Read from the source with `ast`, so a new module or import that breaks the shape fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENGINE = ROOT / "engine"

# A room may import from rooms of its own tier or below, never above.
TIERS = {
    "config": 0,
    "trace": 0,
    "errors": 0,
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
            assert room(module) in TIERS, f"{module} is outside the rooms of the README"


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


def test_readme_layout_lists_every_engine_module():
    """The README's Layout section names every package and module under engine/, and nothing
    that is not there."""
    readme = (ROOT / "README.md").read_text()
    layout = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
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
    assert sorted(modules - listed) == [], "modules missing from the README layout"
    assert sorted(listed - modules) == [], "README layout lists modules that do not exist"
