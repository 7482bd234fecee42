"""The house's walls: the import-linter contracts in `.importlinter` (layers with the research
harness on top, no cycles), every package module placed in a layer, and no module too long to
read in one sitting."""

import configparser
import pathlib

from importlinter import cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jaxrl_llm"


def test_import_contracts_are_kept():
    assert cli.lint_imports(config_filename=str(ROOT / ".importlinter")) == cli.EXIT_STATUS_SUCCESS


def test_the_research_harness_is_the_top_layer():
    contract = configparser.ConfigParser()
    contract.read(ROOT / ".importlinter")
    layers = contract["importlinter:contract:layers"]["layers"].split()
    assert layers[0] == "research" and contract["importlinter:contract:layers"]["exhaustive"] == "true"


def test_no_module_is_longer_than_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long


def test_the_main_classes_stay_small():
    """Learner, Orchestrator and Sampler own one job each; their parts live in modules of their own."""
    import ast

    wanted = {"learner/learner.py": "Learner", "runtime/orchestrator.py": "Orchestrator",
              "rollout/sampler.py": "Sampler"}
    for path, name in wanted.items():
        tree = ast.parse((PACKAGE / path).read_text())
        (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
        assert cls.end_lineno - cls.lineno + 1 <= 150, (name, cls.end_lineno - cls.lineno + 1)


def test_every_package_says_what_it_owns_and_what_it_may_import():
    import ast

    for init in sorted(PACKAGE.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert len(doc) > 80 and "import" in doc, (init.parent.name, doc)


def test_no_function_is_longer_than_80_lines():
    import ast

    long = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long[f"{path.relative_to(ROOT)}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert not long, long


def _self_targets(node):
    """`self.x` names a statement assigns directly (tuple targets included)."""
    import ast

    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    out = []
    for t in targets:
        for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
            if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                out.append(e.attr)
    return out


def test_no_class_creates_attributes_outside_init():
    """A reader finds every attribute of an object in its `__init__` or its base classes' (methods
    may rebind them)."""
    import ast

    kinds = (ast.Assign, ast.AugAssign, ast.AnnAssign)
    assigned = lambda f: {a for n in ast.walk(f) if isinstance(n, kinds) for a in _self_targets(n)}  # noqa: E731
    classes = []  # (path, class node, its methods)
    own = {}  # class name -> (attributes its __init__ declares, base class names)
    for path in sorted(PACKAGE.rglob("*.py")):
        for cls in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)):
            methods = [f for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
            init = next((f for f in methods if f.name == "__init__"), None)
            own[cls.name] = (assigned(init) if init else set(), [b.id for b in cls.bases if isinstance(b, ast.Name)])
            classes.append((path, cls, methods, init))

    def declared(name):
        attrs, bases = own.get(name, (set(), []))
        return attrs.union(*(declared(b) for b in bases))

    late = {}
    for path, cls, methods, init in classes:
        if init is None and not any(b in own for b in own[cls.name][1]):
            continue
        for f in methods:
            if f is not init and (extra := assigned(f) - declared(cls.name)):
                late[f"{path.relative_to(ROOT)}:{cls.name}.{f.name}"] = sorted(extra)
    assert not late, late
