"""docs/design.md names what exists, where it says: every file it names is there, every symbol it quotes is defined
in the project (a module, class, function, attribute or field), a dotted `sce.module.name` resolves in that module,
and a symbol it places in a file (`NAME` in `FILE`, `NAME` (`FILE`), `FILE`'s `NAME`) is defined in that file."""
import ast
import glob
import os
import re

import torch

from conftest import REPO

DOC = os.path.join(REPO, "docs", "design.md")
SOURCES = [p for pattern in ("*.py", "sce/**/*.py", "benchmarks/**/*.py", "detection/**/*.py")
           for p in glob.glob(os.path.join(REPO, pattern), recursive=True)]


def defined(path):
    """The names a Python file defines: functions, classes, assigned names and attributes, fields (and what a
    package's __init__.py imports: its face)."""
    names = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ImportFrom) and path.endswith("__init__.py"):  # a package's face re-exports
            names.update(a.asname or a.name for a in node.names)
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            for t in ast.walk(target):
                names.add(t.id if isinstance(t, ast.Name) else t.attr if isinstance(t, ast.Attribute) else None)
    return names - {None}


def quoted(text):
    """The doc's backquoted symbols (calls' arguments dropped); paths and flags apart."""
    for token in re.findall(r"`([^`]+)`", text):
        name = token.split("(")[0]
        if re.fullmatch(r"[A-Za-z_][\w.]*", name) and not name.endswith((".py", ".sh", ".md", ".txt")):
            yield name


def test_design_names_what_exists_where_it_says():
    text = open(DOC).read()
    by_file = {os.path.relpath(p, REPO): defined(p) for p in SOURCES}
    everywhere = set().union(*by_file.values()) | {os.path.splitext(os.path.basename(p))[0] for p in by_file}
    everywhere |= {"sce", "data", "functools", "torch", "threading"}  # and what other packages define
    for path in re.findall(r"`((?:sce|benchmarks|tests|docs|detection)/[\w/.]+\.(?:py|sh|md))`", text):
        assert os.path.exists(os.path.join(REPO, path)), path
    missing = [n for n in set(quoted(text)) if not (n.split(".")[0] in ("functools", "torch", "threading") or all(
        part in everywhere for part in n.split(".")))]
    assert not missing, f"docs/design.md names what the code does not define: {sorted(missing)}"
    for name in set(quoted(text)):
        if name.startswith("sce.") and name.count(".") >= 2:  # sce.module.name[.attr]: defined in that module
            parts = name.split(".")
            for i in range(len(parts) - 1, 1, -1):
                module = os.path.join(*parts[:i])
                files = [f"{module}.py", os.path.join(module, "__init__.py")]
                found = [by_file[f] for f in files if f in by_file]
                if found:
                    assert parts[i] in set().union(*found), f"{name}: {parts[i]} is not in {module}"
                    break
    placed = re.findall(r"`(\w+)[^`]*` in `((?:sce|benchmarks)/[\w/]+\.py)`", text)
    placed += re.findall(r"`(\w+)[^`]*` \(`((?:sce|benchmarks)/[\w/]+\.py)`", text)
    placed += [(n, f) for f, n in re.findall(r"`((?:sce|benchmarks)/[\w/]+\.py)`'s `(\w+)", text)]
    assert placed, "no symbol placed in a file: the patterns above no longer match the doc"
    for name, path in placed:
        assert name in by_file[path], f"docs/design.md places {name} in {path}, which does not define it"


def test_design_lists_the_settings_layers_the_sources_name():
    """docs/design.md's list of the settings' layers is the one sce.settings.resolve applies: a run's every source
    starts with one of its labels (or derived / no effect), and a row's value, a typed flag and the device's each
    carry their layer's."""
    import main_pretrain
    text = open(DOC).read()
    section = text[text.index("## The settings"):text.index("## The files")]
    labels = re.findall(r"^\d\. \*\*([a-z ]+)\*\*:", section, re.M)
    assert labels == ["default", "method", "recipe", "run", "device", "flag"], labels
    settings = main_pretrain.parse_args(["--data", "DIR", "--recipe", "cifar10", "--lr", "0.1"], torch.device("cpu"))
    firsts = {source.split(":")[0].split(" (")[0].split(" ")[0] for source in settings.sources.values()}
    assert firsts <= set(labels) | {"derived", "no"}, firsts
    assert settings.sources["lr"] == "flag" and settings.sources["queue_size"].startswith("recipe cifar10")
    assert settings.sources["tau"].startswith("recipe") and settings.sources["online_aug"].startswith("method")
    assert settings.sources["compile"].startswith("device")
