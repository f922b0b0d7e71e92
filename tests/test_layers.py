"""The project's modules form layers: no import cycle (lazy imports inside functions count too), the entry
points (train.py, train_graph.py, predict.py) are imported by nothing below them, and the bottom modules
(errors, symmetry) import nothing of ours, units only symmetry (the data layout it stores)."""
import ast

from conftest import REPO_ROOT

ENTRY_POINTS = {"train", "train_graph", "predict"}


def project_modules():
    files = [*REPO_ROOT.glob("utils/**/*.py"), *REPO_ROOT.glob("networks/*.py"),
             *(REPO_ROOT / f"{name}.py" for name in ENTRY_POINTS)]
    modules = {}
    for path in files:
        name = ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    return modules


def import_graph():
    modules = project_modules()
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                candidates = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            targets.update(c for c in candidates if c in modules and c != name)
        graph[name] = targets
    return graph


def find_cycle(graph):
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_graph_is_real():
    graph = import_graph()
    assert "utils" in graph["utils.checkpoint"] and "utils.run_dir" in graph["train"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycle():
    assert find_cycle(import_graph()) is None


def test_nothing_imports_an_entry_point_but_an_entry_point():
    graph = import_graph()
    offenders = {name: sorted(targets & ENTRY_POINTS) for name, targets in graph.items()
                 if targets & ENTRY_POINTS and name not in ENTRY_POINTS}
    assert not offenders


def test_the_bottom_modules_import_nothing_of_ours():
    graph = import_graph()
    assert graph["utils"] == graph["utils.symmetry"] == set() and graph["utils.units"] == {"utils.symmetry"}
