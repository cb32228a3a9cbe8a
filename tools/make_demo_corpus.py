"""Build a small English corpus offline from the Python standard library's documentation.

Writes loose JSON lines, one ``{"text": ...}`` document per line, ready for
tools/train_tokenizer.py and tools/preprocess_data.py::

    python tools/make_demo_corpus.py --output corpus.jsonl --min-chars 200

Documents are the docstrings of a fixed list of pure-Python stdlib modules (module,
class, function and method docstrings, each headed by its qualified name) plus the
language-reference topics shipped with pydoc.  They are deduplicated and sorted, so
the output depends only on the Python version, and on whether it runs in a virtual
environment: signatures show default values, and ``sysconfig.get_paths``'s default
scheme is 'venv' there ('posix_prefix' outside), which changes the tokenizer and the
demo's losses slightly (validation 6.23 against 6.17 at iteration 100, session 19).  ``--extra-text FILE`` appends plain
text files cut into paragraph groups.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import io
import json
import os
import sys
import warnings
from contextlib import redirect_stdout, redirect_stderr
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

# Pure-Python modules that import without side effects (no GUI, no tests run, no
# network).  Missing ones (e.g. a Python built without some module) are skipped.
DEFAULT_MODULES = (
    "abc argparse ast asyncio asyncio.base_events asyncio.events asyncio.futures "
    "asyncio.locks asyncio.queues asyncio.streams asyncio.tasks base64 bdb bisect bz2 "
    "calendar cgi cmd code codecs collections collections.abc colorsys concurrent.futures "
    "configparser contextlib copy copyreg csv dataclasses datetime decimal difflib dis "
    "doctest email email.message email.parser email.policy email.utils enum filecmp "
    "fileinput fnmatch fractions ftplib functools getopt getpass gettext glob gzip "
    "hashlib heapq hmac html html.parser http http.client http.cookiejar http.cookies "
    "http.server imaplib importlib importlib.abc importlib.metadata importlib.resources "
    "importlib.util inspect io ipaddress json json.decoder json.encoder keyword "
    "linecache locale logging logging.config logging.handlers lzma mailbox mimetypes "
    "multiprocessing multiprocessing.pool multiprocessing.managers netrc numbers "
    "opcode operator optparse os pathlib pdb pickle pickletools pkgutil platform plistlib "
    "poplib posixpath pprint profile pstats py_compile pyclbr pydoc queue quopri random "
    "re reprlib rlcompleter runpy sched secrets selectors shelve shlex shutil signal "
    "site smtplib socket socketserver sqlite3 ssl stat statistics string struct "
    "subprocess symtable sysconfig tabnanny tarfile tempfile textwrap threading timeit "
    "token tokenize tomllib trace traceback tracemalloc types typing unittest "
    "unittest.case unittest.mock unittest.result unittest.suite urllib.error "
    "urllib.parse urllib.request urllib.response urllib.robotparser uuid warnings wave "
    "weakref webbrowser wsgiref.handlers wsgiref.simple_server wsgiref.util "
    "xml.dom.minidom xml.dom.pulldom xml.etree.ElementTree xml.sax xml.sax.handler "
    "xml.sax.saxutils xmlrpc.client xmlrpc.server zipapp zipfile zipimport zoneinfo "
    # More packages' submodules, C modules with documented APIs, deprecated modules
    # still shipped in 3.11, and Tk (skipped where Python was built without it).
    "aifc array asynchat asyncio.protocols asyncio.runners asyncio.sslproto "
    "asyncio.subprocess asyncio.transports asyncio.unix_events asyncore atexit binascii "
    "builtins chunk cmath codeop compileall concurrent.futures.process "
    "concurrent.futures.thread contextvars ctypes ctypes.util dbm email.charset "
    "email.feedparser email.generator email.header email.headerregistry email.iterators "
    "email.mime.base email.mime.multipart email.mime.text email.contentmanager errno "
    "faulthandler gc graphlib imghdr imp itertools lib2to3.pgen2.driver lib2to3.pytree "
    "lib2to3.refactor mailcap marshal math mmap modulefinder "
    "multiprocessing.connection multiprocessing.context multiprocessing.process "
    "multiprocessing.queues multiprocessing.shared_memory multiprocessing.synchronize "
    "nntplib os.path pipes select smtpd sndhdr sre_parse stringprep sunau sys telnetlib "
    "time tkinter tkinter.filedialog tkinter.ttk turtle unicodedata uu xdrlib "
    "xml.dom.expatbuilder xml.etree.ElementPath xml.sax.expatreader xml.sax.xmlreader zlib"
).split()


def _import_quietly(name: str):
    """Import ``name`` or return None; deprecation noise and prints are swallowed."""
    sink = io.StringIO()
    with warnings.catch_warnings(), redirect_stdout(sink), redirect_stderr(sink):
        warnings.simplefilter("ignore")
        try:
            return importlib.import_module(name)
        except Exception:  # noqa: BLE001 - any import failure just means "skip it"
            return None


def _members(owner: object) -> List[Tuple[str, object]]:
    # vars() rather than dir(): only what the owner itself defines, not inherited names.
    try:
        items = list(vars(owner).items())
    except TypeError:
        return []
    return sorted(items, key=lambda kv: kv[0])


def _own_doc(obj: object) -> str:
    # obj.__doc__, not inspect.getdoc: getdoc copies a base class's docstring into every
    # override, which would repeat the same text many times.
    doc = getattr(obj, "__doc__", None)
    return inspect.cleandoc(doc) if isinstance(doc, str) and doc.strip() else ""


class _Elided:
    def __repr__(self) -> str:
        return "..."


_SAFE_DEFAULTS = (bool, int, float, type(None))


def _machine_strings() -> set:
    """Strings that describe this machine or user (never to be written to the corpus)."""
    # Values under 4 characters ("1", "yes") are flags, not identifying, and common defaults.
    private = {v for v in os.environ.values() if len(v) >= 4}
    private.update({os.getcwd(), os.path.expanduser("~"), os.path.basename(os.path.expanduser("~"))})
    return private


def _heading(qualname: str, obj: object) -> str:
    """``qualname(signature)`` with annotations dropped and only simple defaults shown.

    Arbitrary default values must not be printed: some are run-specific
    (``<object at 0x...>``) and some are private, e.g. ``cgi.parse(environ=os.environ)``
    would copy this machine's environment variables into the corpus.
    """
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return qualname
    params = []
    private = _machine_strings()
    for p in sig.parameters.values():
        default = p.default
        if default is not p.empty and not (
            isinstance(default, _SAFE_DEFAULTS)
            or (isinstance(default, str) and len(default) <= 20 and default not in private)
        ):
            default = _Elided()
        params.append(p.replace(default=default, annotation=p.empty))
    return qualname + str(sig.replace(parameters=params, return_annotation=sig.empty))


def _wanted(name: str, obj: object) -> bool:
    # Dunders are mostly slot wrappers ("Return self==value.") repeated on every type.
    if name.startswith("__") and name not in ("__init__", "__call__"):
        return False
    return inspect.isclass(obj) or inspect.isroutine(obj) or isinstance(obj, property)


def _class_sections(qualname: str, cls: type, depth: int) -> Iterator[str]:
    """The docstrings of a class and its own methods/properties/nested classes."""
    doc = _own_doc(cls)
    if doc:
        yield f"class {_heading(qualname, cls)}\n\n{doc}"
    for name, obj in _members(cls):
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
        if not _wanted(name, obj):
            continue
        if inspect.isclass(obj):
            if depth > 0:
                yield from _class_sections(f"{qualname}.{name}", obj, depth - 1)
            continue
        doc = _own_doc(obj)
        if doc:
            heading = f"{qualname}.{name}" if isinstance(obj, property) else _heading(f"{qualname}.{name}", obj)
            yield f"{heading}\n\n{doc}"


def _module_documents(module) -> Iterator[Tuple[str, List[str]]]:
    """Yield (name, sections): the module docstring, each function, each class with its members."""
    mod_name = module.__name__
    doc = _own_doc(module)
    if doc:
        yield mod_name, [f"module {mod_name}\n\n{doc}"]
    for name, obj in _members(module):
        if not _wanted(name, obj) or isinstance(obj, property):
            continue
        # Skip re-exports: they are documented under their defining module.
        if getattr(obj, "__module__", None) != mod_name:
            continue
        qualname = f"{mod_name}.{name}"
        if inspect.isclass(obj):
            yield qualname, list(_class_sections(qualname, obj, depth=2))
        else:
            doc = _own_doc(obj)
            if doc:
                yield qualname, [f"{_heading(qualname, obj)}\n\n{doc}"]


def _pydoc_topics() -> Iterator[Tuple[str, str]]:
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return
    for key in sorted(topics):
        yield f"topic:{key}", topics[key].strip()


def _extra_documents(path: str, target_chars: int) -> Iterator[Tuple[str, str]]:
    """Cut a plain-text file into documents of consecutive paragraphs (>= target_chars)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--extra-text: no such file: {path!r}")
    try:
        with open(path, encoding="utf-8") as f:
            paragraphs = [p.strip() for p in f.read().split("\n\n") if p.strip()]
    except UnicodeDecodeError as exc:
        raise ValueError(f"--extra-text {path!r}: not UTF-8 text ({exc.reason}, byte "
                         f"{exc.object[exc.start:exc.start + 1]!r} at offset {exc.start}); "
                         f"expected a plain-text file") from None
    current: List[str] = []
    size, part = 0, 0
    for para in paragraphs:
        current.append(para)
        size += len(para)
        if size >= target_chars:
            yield f"{path}#{part}", "\n\n".join(current)
            current, size, part = [], 0, part + 1
    if current:
        yield f"{path}#{part}", "\n\n".join(current)


def _walk_quietly(module) -> List[Tuple[str, List[str]]]:
    # Touching some attributes (typing.io, deprecated aliases) warns; that is noise here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return list(_module_documents(module))


def collect_documents(
    modules: Sequence[str], min_chars: int, include_topics: bool = True
) -> List[str]:
    """One document per module docstring, function, class (with its members) and pydoc
    topic; repeated sections dropped; sorted by name; documents under min_chars dropped."""
    documents: Dict[str, str] = {}
    seen: set = set()
    for mod_name in modules:
        module = _import_quietly(mod_name)
        if module is None:
            continue
        for name, sections in _walk_quietly(module):
            # Aliases (``Foo = Bar``) and shared helpers would otherwise repeat text.
            fresh = [s for s in sections if s.split("\n\n", 1)[1] not in seen]
            seen.update(s.split("\n\n", 1)[1] for s in fresh)
            text = "\n\n".join(fresh)
            if name not in documents and len(text) >= min_chars:
                documents[name] = text
    if include_topics:
        for name, text in _pydoc_topics():
            if text not in seen and len(text) >= min_chars:
                seen.add(text)
                documents[name] = text
    return [documents[name] for name in sorted(documents)]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", required=True, help="JSON-lines file to write")
    p.add_argument("--min-chars", type=int, default=200, help="drop shorter docstrings")
    p.add_argument("--modules", default=None,
                   help="comma-separated module list instead of the built-in one")
    p.add_argument("--no-topics", dest="topics", action="store_false",
                   help="leave out pydoc's language-reference topics")
    p.add_argument("--extra-text", action="append", default=[], metavar="FILE",
                   help="plain-text file to append (repeatable)")
    p.add_argument("--extra-doc-chars", type=int, default=2000,
                   help="approximate document size when cutting --extra-text files")
    args = p.parse_args(argv)
    if args.min_chars < 0:
        p.error(f"--min-chars must be >= 0, got {args.min_chars}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    # Read the extra files first: a bad one fails before the slow walk over the modules.
    extra = [d for path in args.extra_text
             for _, d in _extra_documents(path, args.extra_doc_chars)]
    modules = args.modules.split(",") if args.modules else list(DEFAULT_MODULES)
    docs = collect_documents([m.strip() for m in modules if m.strip()], args.min_chars, args.topics)
    docs.extend(extra)
    out_dir = os.path.dirname(os.path.abspath(args.output))
    os.makedirs(out_dir, exist_ok=True)
    n_chars = 0
    with open(args.output, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
            n_chars += len(doc.encode("utf-8"))
    print(f"wrote {args.output}: {len(docs)} documents, {n_chars / 1e6:.2f} MB of text")
    return 0


def _command_line(argv: Optional[Sequence[str]] = None) -> int:
    """``main`` for the shell: an --extra-text problem becomes one ``error:`` line and
    exit status 2 instead of a traceback."""
    from megatron.errors import UserError

    try:
        return main(argv)
    except (ValueError, OSError) as exc:
        raise UserError(str(exc)) from exc


if __name__ == "__main__":
    # Running as a script puts tools/ first on sys.path; a tool named like a stdlib
    # module (e.g. tools/trace.py) would then be documented instead of the real one.
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)
    from megatron.entry import run_entry_point

    run_entry_point(_command_line)
