"""Build the embedded default corpus from the Python standard library's own documentation.

Run once by a maintainer (``python -m meshtron.data.build_corpus``) and commit the result,
``meshtron/data/stdlib_docs.txt.gz``: training only reads the committed file, so every machine trains on the
same bytes whatever Python version it has. See docs/data.md, 'The built-in corpus'.
"""

from __future__ import annotations

import contextlib
import gzip
import importlib
import inspect
import io
import pkgutil
import sys
import warnings
from pathlib import Path

from meshtron.data.sources import DOC_SEPARATOR

OUTPUT = Path(__file__).with_name("stdlib_docs.txt.gz")

# Modules that act on import (open a browser, print, start a GUI) or are test suites and tools.
_SKIP = {
    "antigravity",
    "this",
    "idlelib",
    "tkinter",
    "turtle",
    "turtledemo",
    "test",
    "lib2to3",
    "ensurepip",
    "pydoc_data",
    "venv",
    "__main__",
    "xxsubtype",
    "xxlimited",
    "sre_compile",
    "sre_constants",
    "sre_parse",
}


def _public(name: str) -> bool:
    return all(not part.startswith("_") for part in name.split("."))


def _module_names() -> list[str]:
    """Public stdlib modules and their public submodules, sorted."""
    names = set()
    for top in sorted(sys.stdlib_module_names):
        if top in _SKIP or not _public(top):
            continue
        names.add(top)
        module = _quiet_import(top)
        for info in pkgutil.walk_packages(
            getattr(module, "__path__", []), prefix=top + ".", onerror=lambda _name: None
        ):
            parts = info.name.split(".")
            if _public(info.name) and not any(p in _SKIP or p.startswith("test") for p in parts):
                names.add(info.name)
    return sorted(names)


def _quiet_import(name: str):
    """Import for its docstrings only; modules that fail to import on this platform are left out."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            return importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - some modules exit or raise oddities on import
            return None


def _doc(obj) -> str:
    # The object's own docstring: inspect.getdoc would repeat inherited ones for every subclass.
    doc = obj.__doc__ if isinstance(getattr(obj, "__doc__", None), str) else ""
    return inspect.cleandoc(doc) if doc else ""


def _signature(obj) -> str:
    try:
        text = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"
    # Reprs such as "<object object at 0x7f...>" differ from run to run.
    return "(...)" if " at 0x" in text else text


def _indent(text: str) -> str:
    return "\n".join("    " + line if line else "" for line in text.splitlines())


def _entry(header: str, doc: str) -> str:
    return f"{header}\n{_indent(doc)}" if doc else ""


def _members(module) -> list[tuple[str, object]]:
    return [
        (name, obj)
        for name, obj in sorted(vars(module).items())
        if _public(name)
        and (inspect.isclass(obj) or inspect.isroutine(obj))
        and getattr(obj, "__module__", None) == module.__name__
    ]


def _class_text(name: str, cls) -> str:
    methods = []
    for attr, member in sorted(vars(cls).items()):
        func = getattr(member, "__func__", member)  # staticmethod / classmethod
        if _public(attr) and inspect.isroutine(func):
            methods.append(_indent(_entry(f"def {attr}{_signature(func)}", _doc(func))))
    methods = [m for m in methods if m]
    doc = _doc(cls)
    if not (doc or methods):
        return ""
    return "\n\n".join([f"class {name}{_signature(cls)}" + (f"\n{_indent(doc)}" if doc else ""), *methods])


def module_document(name: str) -> str:
    """Plain-text documentation of one module, or "" when it has none."""
    module = _quiet_import(name)
    if module is None:
        return ""
    parts = [_doc(module)]
    for member_name, obj in _members(module):
        if inspect.isclass(obj):
            parts.append(_class_text(member_name, obj))
        else:
            parts.append(_entry(f"def {member_name}{_signature(obj)}", _doc(obj)))
    body = "\n\n".join(p for p in parts if p)
    return f"Module {name}\n\n{body}\n" if body else ""


def topic_documents() -> list[str]:
    """The language reference topics that ``help("if")`` shows, one document each."""
    from pydoc_data.topics import topics

    return [f"Topic {name}\n\n{topics[name].strip()}\n" for name in sorted(topics)]


def build(output: Path = OUTPUT) -> tuple[int, int]:
    """Write the corpus; returns (documents, uncompressed bytes)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        modules = [module_document(name) for name in _module_names()]
    docs = [d.replace(DOC_SEPARATOR, "") for d in topic_documents() + modules if d]
    data = DOC_SEPARATOR.join(docs).encode("utf-8")
    # mtime=0 keeps the gzip header, and so the committed file, identical across rebuilds.
    output.write_bytes(gzip.compress(data, compresslevel=9, mtime=0))
    return len(docs), len(data)


if __name__ == "__main__":
    count, size = build()
    print(
        f"wrote {OUTPUT}: {count} documents, {size} bytes of text, "
        f"{OUTPUT.stat().st_size} bytes compressed (Python {sys.version.split()[0]})"
    )
