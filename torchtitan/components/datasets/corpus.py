"""A small English corpus built offline from documentation that ships with Python itself.

Two sources, both present in every CPython installation, so training works without network access
and without text copied into this repository:

* `pydoc_data.topics.topics`: the Python Language Reference sections that `help()` shows for
  keywords and topics, cut into paragraph-aligned documents;
* the docstrings of a fixed list of standard-library modules and of the functions, classes and
  methods they define, grouped per module into documents of the same size.

The text (and therefore the corpus) depends on the Python version, but for one interpreter it is the
same, in the same order, in every process. A stable hash of each document's text puts about 2% of the
documents in the validation split, so a document never lands in both splits.
"""

import functools
import hashlib
import importlib
import inspect
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from torchtitan.errors import UserError
from torchtitan.tools.files import atomic_write, cache_dir
from torchtitan.tools.logging import logger

SPLITS = ("train", "validation")

# Modules that import quickly and without side effects (no terminal, GUI or network access, no
# deprecation notices); any that are missing from a given build are skipped.
_MODULES = (
    "_pydecimal",
    "_pyio",
    "_strptime",
    "_threading_local",
    "abc",
    "argparse",
    "array",
    "ast",
    "asyncio.base_events",
    "asyncio.events",
    "asyncio.futures",
    "asyncio.locks",
    "asyncio.protocols",
    "asyncio.queues",
    "asyncio.runners",
    "asyncio.selector_events",
    "asyncio.sslproto",
    "asyncio.staggered",
    "asyncio.streams",
    "asyncio.subprocess",
    "asyncio.taskgroups",
    "asyncio.tasks",
    "asyncio.timeouts",
    "asyncio.transports",
    "asyncio.unix_events",
    "atexit",
    "base64",
    "bdb",
    "binascii",
    "bisect",
    "builtins",
    "bz2",
    "cProfile",
    "calendar",
    "cmath",
    "cmd",
    "code",
    "codecs",
    "codeop",
    "collections",
    "collections.abc",
    "colorsys",
    "compileall",
    "concurrent.futures._base",
    "concurrent.futures.process",
    "concurrent.futures.thread",
    "configparser",
    "contextlib",
    "contextvars",
    "copy",
    "copyreg",
    "csv",
    "ctypes",
    "dataclasses",
    "datetime",
    "dbm",
    "dbm.dumb",
    "difflib",
    "dis",
    "doctest",
    "email._encoded_words",
    "email._header_value_parser",
    "email._policybase",
    "email.base64mime",
    "email.charset",
    "email.contentmanager",
    "email.feedparser",
    "email.generator",
    "email.header",
    "email.headerregistry",
    "email.iterators",
    "email.message",
    "email.mime.multipart",
    "email.parser",
    "email.policy",
    "email.quoprimime",
    "email.utils",
    "enum",
    "errno",
    "faulthandler",
    "fcntl",
    "filecmp",
    "fileinput",
    "fnmatch",
    "fractions",
    "ftplib",
    "functools",
    "gc",
    "getopt",
    "getpass",
    "gettext",
    "glob",
    "graphlib",
    "grp",
    "gzip",
    "hashlib",
    "heapq",
    "hmac",
    "html",
    "html.parser",
    "http",
    "http.client",
    "http.cookiejar",
    "http.cookies",
    "http.server",
    "imaplib",
    "importlib",
    "importlib._bootstrap",
    "importlib._bootstrap_external",
    "importlib.abc",
    "importlib.machinery",
    "importlib.metadata",
    "importlib.resources",
    "importlib.resources.abc",
    "importlib.util",
    "inspect",
    "io",
    "ipaddress",
    "itertools",
    "json",
    "json.decoder",
    "json.encoder",
    "keyword",
    "linecache",
    "locale",
    "logging",
    "logging.config",
    "logging.handlers",
    "lzma",
    "mailbox",
    "marshal",
    "math",
    "mimetypes",
    "mmap",
    "modulefinder",
    "multiprocessing.connection",
    "multiprocessing.context",
    "multiprocessing.managers",
    "multiprocessing.pool",
    "multiprocessing.process",
    "multiprocessing.queues",
    "multiprocessing.reduction",
    "multiprocessing.shared_memory",
    "multiprocessing.synchronize",
    "netrc",
    "numbers",
    "opcode",
    "operator",
    "optparse",
    "os",
    "pathlib",
    "pdb",
    "pickle",
    "pickletools",
    "pkgutil",
    "platform",
    "plistlib",
    "poplib",
    "posixpath",
    "pprint",
    "profile",
    "pstats",
    "pty",
    "pwd",
    "py_compile",
    "pyclbr",
    "pydoc",
    "queue",
    "quopri",
    "random",
    "re",
    "reprlib",
    "runpy",
    "sched",
    "secrets",
    "select",
    "selectors",
    "shelve",
    "shlex",
    "shutil",
    "signal",
    "smtplib",
    "socket",
    "socketserver",
    "sqlite3",
    "statistics",
    "string",
    "stringprep",
    "struct",
    "subprocess",
    "symtable",
    "sys",
    "sysconfig",
    "tabnanny",
    "tarfile",
    "tempfile",
    "termios",
    "textwrap",
    "threading",
    "time",
    "timeit",
    "token",
    "tokenize",
    "tomllib",
    "trace",
    "traceback",
    "tracemalloc",
    "types",
    "typing",
    "unicodedata",
    "unittest.case",
    "unittest.loader",
    "unittest.main",
    "unittest.mock",
    "unittest.result",
    "unittest.runner",
    "unittest.suite",
    "urllib.error",
    "urllib.parse",
    "urllib.request",
    "urllib.robotparser",
    "uuid",
    "warnings",
    "wave",
    "weakref",
    "wsgiref.handlers",
    "wsgiref.headers",
    "wsgiref.simple_server",
    "wsgiref.util",
    "wsgiref.validate",
    "xml.dom.expatbuilder",
    "xml.dom.minidom",
    "xml.dom.pulldom",
    "xml.etree.ElementTree",
    "xml.sax.handler",
    "xml.sax.saxutils",
    "xml.sax.xmlreader",
    "xmlrpc.client",
    "xmlrpc.server",
    "zipapp",
    "zipfile",
    "zipimport",
    "zlib",
    "zoneinfo",
)

# Documents grow paragraph by paragraph until they reach the target; a paragraph that would push one
# past the maximum starts the next document instead, and a longer single paragraph is cut at lines.
_TARGET_CHARS = 1500
_MAX_CHARS = 4000
# Docstrings shorter than this are mostly one-line stubs ("Return self.") that add noise, not text.
_MIN_DOCSTRING_CHARS = 40
_VALIDATION_PERCENT = 2

_BLANK_LINE = re.compile(r"\n[ \t]*\n")
# Signature defaults of these types print the same in every process; others (sentinels, functions,
# mutable module state) may show memory addresses or live contents, which would make the corpus, and
# any tokenizer trained on it, differ from run to run.
_LITERAL_TYPES = (bool, int, float, complex, str, bytes, type(None))


class _Elided:
    def __repr__(self) -> str:
        return "..."


def embedded_corpus(split: str) -> list[str]:
    """Return the documents of `split` ("train" or "validation") of the built-in corpus."""
    if split not in SPLITS:
        raise UserError(
            f"embedded corpus split {split!r} does not exist; valid splits are {', '.join(SPLITS)}"
        )
    return list(_splits()[split])


def is_validation(document: str) -> bool:
    """Whether `document` belongs to the validation split: decided by its text alone, so stably."""
    digest = hashlib.sha256(document.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 100 < _VALIDATION_PERCENT


@functools.lru_cache(maxsize=1)
def _splits() -> dict[str, tuple[str, ...]]:
    begin = time.perf_counter()
    documents = list(dict.fromkeys(_cached_documents()))
    logger.info(f"embedded corpus: {len(documents):,} documents in {time.perf_counter() - begin:.1f} s")
    return {
        "train": tuple(d for d in documents if not is_validation(d)),
        "validation": tuple(d for d in documents if is_validation(d)),
    }


def _cached_documents() -> list[str]:
    """The documents, built once per interpreter and corpus definition and then read from the cache directory: the
    build takes half a second of every process's start-up, every rank's and every test's. The file's name holds a
    hash of what the text depends on: the Python version and standard library, the interpreter's path (a default
    value in `platform.architecture`'s signature, so each virtual environment has a corpus of its own), and this
    module's source."""
    depends_on = f"{sys.version}\0{sys.base_prefix}\0{sys.executable}\0".encode() + Path(__file__).read_bytes()
    key = hashlib.sha256(depends_on)
    cache_file = cache_dir() / f"embedded_corpus-{key.hexdigest()[:16]}.json"
    try:
        return json.loads(cache_file.read_text())
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as exc:
        logger.warning(f"embedded corpus: ignoring the unreadable cache {cache_file} ({exc}); building it again")
    logger.info("embedded corpus: collecting Python's own documentation (about a second, once per interpreter)")
    documents = _documents_from_pristine_interpreter()
    try:
        with atomic_write(cache_file) as f:
            json.dump(documents, f)
    except OSError as exc:
        logger.warning(f"embedded corpus: cannot cache it in {cache_file} ({exc}); every process will build it")
    return documents


def _documents_from_pristine_interpreter() -> list[str]:
    """Build the documents in a fresh interpreter that loads nothing beyond the standard library.

    Docstrings are read from live objects, and packages imported into this process replace some of
    them (torch swaps inspect.getfile, typing_extensions some typing helpers). Every process, every
    rank of a job included, must see the same corpus whatever it imported, so a child started with
    -I -S (no site-packages, no .pth hooks, no PYTHON* variables) collects the text instead.
    """
    package_root = Path(__file__).resolve().parents[3]
    code = (
        "import runpy, sys\n"
        f"sys.path.insert(0, {str(package_root)!r})\n"
        f"runpy.run_path({str(Path(__file__).resolve())!r}, run_name='__main__')\n"
    )
    child = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True)
    if child.returncode != 0:
        raise RuntimeError(f"Building the embedded corpus failed:\n{child.stderr}")
    return json.loads(child.stdout)


def _all_documents() -> Iterator[str]:
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield from _pack([topics[name]])
    seen: set[str] = set()
    for module_name in _MODULES:
        yield from _pack(_module_sections(module_name, seen))


def _module_sections(module_name: str, seen: set[str]) -> Iterator[str]:
    """Yield "name(signature)" + docstring sections for a module and what it defines.

    `seen` holds docstrings already used, so text shared through inheritance or re-export appears
    once in the whole corpus.
    """
    try:
        module = importlib.import_module(module_name)
    except Exception:  # a module this interpreter lacks or cannot load simply contributes nothing
        return
    yield from _section(module_name, module, seen)
    # Pure-Python twins such as _pydecimal present themselves under the public module's name.
    own_names = {module_name, getattr(module, "__name__", module_name)}
    for name, obj in sorted(vars(module).items()):
        if getattr(obj, "__module__", None) not in own_names:
            continue
        if inspect.isclass(obj):
            yield from _section(name, obj, seen)
            for member_name, member in sorted(vars(obj).items()):
                if member_name.startswith("__") and member_name != "__init__":
                    continue
                if inspect.isroutine(member) or isinstance(member, property):
                    yield from _section(f"{name}.{member_name}", member, seen)
        elif inspect.isroutine(obj):
            yield from _section(name, obj, seen)


def _section(title: str, obj: object, seen: set[str]) -> Iterator[str]:
    doc = getattr(obj, "__doc__", None)
    if not isinstance(doc, str):
        return
    doc = inspect.cleandoc(doc)
    if len(doc) < _MIN_DOCSTRING_CHARS or doc in seen:
        return
    seen.add(doc)
    if callable(obj) and not inspect.isclass(obj):
        title += _signature(obj)
    yield f"{title}\n\n{doc}"


def _signature(obj: object) -> str:
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return ""  # many C functions carry no signature metadata; the name alone still reads fine
    parameters = [
        p if isinstance(p.default, _LITERAL_TYPES) or p.default is p.empty else p.replace(default=_Elided())
        for p in signature.parameters.values()
    ]
    return str(signature.replace(parameters=parameters))


def _pack(sections: Iterable[str]) -> Iterator[str]:
    """Join consecutive paragraphs of `sections` into documents of about `_TARGET_CHARS`."""
    current: list[str] = []
    size = 0
    for section in sections:
        for paragraph in _paragraphs(section):
            if current and size + len(paragraph) > _MAX_CHARS:
                yield "\n\n".join(current)
                current, size = [], 0
            current.append(paragraph)
            size += len(paragraph) + 2
            if size >= _TARGET_CHARS:
                yield "\n\n".join(current)
                current, size = [], 0
    if current:
        yield "\n\n".join(current)


def _paragraphs(text: str) -> Iterator[str]:
    for paragraph in _BLANK_LINE.split(text.strip()):
        paragraph = paragraph.rstrip()
        if not paragraph.strip():
            continue
        if len(paragraph) <= _MAX_CHARS:
            yield paragraph
            continue
        piece: list[str] = []
        size = 0
        for line in paragraph.split("\n"):
            if piece and size + len(line) > _MAX_CHARS:
                yield "\n".join(piece)
                piece, size = [], 0
            piece.append(line)
            size += len(line) + 1
        yield "\n".join(piece)


if __name__ == "__main__":
    json.dump(list(_all_documents()), sys.stdout)
