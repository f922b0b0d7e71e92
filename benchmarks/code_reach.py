"""How much code a reader meets: the project files an entry script reaches through its imports.

    python benchmarks/code_reach.py train.py              # module-level imports: what every run loads
    python benchmarks/code_reach.py train.py --all        # imports inside functions too (the extras)
    python benchmarks/code_reach.py train.py --files      # one line per file

Module-level imports are what a reader must follow to understand the default run; an extra (science metrics,
a fast loader, benchmark mode, the profiler, the tuned convolution forms) is imported inside the function that
uses it, when its config key is on, so it does not count here unless ``--all`` is given.
"""
import argparse
import ast
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def module_file(root, name):
    """The project file of module ``name`` (``a.b`` -> a/b.py or a/b/__init__.py), or None (not the project's)."""
    path = root.joinpath(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_files(root, path, inside_functions=False):
    """The project files ``path`` imports: at module level, or anywhere with ``inside_functions``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    nodes = ast.walk(tree) if inside_functions else tree.body
    names = []
    for node in nodes:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # "from a import b": b may be a submodule of package a
            names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    files = []
    for name in names:
        parts = name.split(".")
        for depth in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__.py and a/b/__init__.py too
            found = module_file(root, ".".join(parts[:depth]))
            if found is not None:
                files.append(found)
    return files


def reach(entry, root=REPO_ROOT, inside_functions=False):
    """{file: line count} of every project file reached from ``entry`` through imports."""
    seen, todo = {}, [Path(entry).resolve()]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen[path] = len(path.read_text().splitlines())
        todo += imported_files(root, path, inside_functions)
    return seen


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("entry", help="the script to start from, e.g. train.py")
    parser.add_argument("--all", action="store_true", help="count imports inside functions too")
    parser.add_argument("--files", action="store_true", help="list the files")
    args = parser.parse_args(argv)
    entry = (REPO_ROOT / args.entry).resolve()
    if not (entry.is_file() and entry.suffix == ".py" and entry.is_relative_to(REPO_ROOT)):
        parser.error(f"{args.entry} is not a Python file of this repository; give its path from the repository's "
                     f"root, e.g. train.py")
    files = reach(entry, inside_functions=args.all)
    if args.files:
        for path, lines in sorted(files.items()):
            print(f"{lines:6d}  {path.relative_to(REPO_ROOT)}")
    kind = "all imports" if args.all else "module-level imports"
    print(f"{args.entry} reaches {sum(files.values())} lines in {len(files)} files ({kind})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
