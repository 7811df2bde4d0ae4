"""The house rules of memkv's source, checked on every ``make lint`` so they do not erode.

Each rule is one that a refactor once restored (issue [3/6], "One wing per
process"); the check keeps it from regrowing. Run it as ``python
scripts/house_check.py``: it prints every breach, one line each, and exits 1
if there is any.

* No module over :data:`MAX_MODULE_LINES` lines (the cold tier's segment files,
  one format, excepted).
* The floors: ``protocol`` imports only itself (and ``errors``), and loading
  it loads neither torch nor ray; ``storage`` (the block engine) imports only
  ``protocol`` and leaves; a wing (``router``, ``device``, ``archive``) imports ``protocol``,
  ``storage``, ``shm`` and leaves, never another wing, an actor, the gateway,
  the cluster client or the config.
* The reader corridor is typed: at most :data:`MAX_API_REMOTE` raw
  ``.remote(`` calls in the gateway (starting and stopping its worker
  actors), none in the in-cluster client.
* No blocking ``ray.get`` inside an ``async def`` of an actor (it stalls the
  actor's event loop; Ray warns at run time, this refuses it at review time).
* Wire headers are decoded once, in ``protocol``, into typed structs: no
  ``header.get(`` anywhere else.
* Each noun that crosses a process is declared once, in ``protocol``: no class
  named like a session view or an append/resume answer anywhere else
  (:data:`ONE_DECLARATION`).
* A ceiling that only goes down: ``dict[str, Any]`` at the process edges
  (actors, gateway, cluster client). Lower it when a change lowers the count.
  What is left is no message between memkv's processes (those are protocol
  structs): documents open by design (OpenAI's bodies, ``/v1/stats``, an
  operation's report), other libraries' own types (an ASGI message, FastAPI's
  OpenAPI document) and the archive journal's file entries (msgpack maps on disk;
  the records in them are typed, :mod:`memkv.router.records`).
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "memkv"

MAX_MODULE_LINES = 600
LONG_MODULES_ALLOWED = {"memkv/storage/segments.py"}
MAX_API_REMOTE = 4
#: A count still being brought down (see the module docstring).
PROCESS_EDGE_DICT_ANY_CEILING = 13

#: Class names that would declare a session view or an append/resume answer a second
#: time (the gateway and the client serve and decode protocol.services' structs).
ONE_DECLARATION = re.compile(r"^(Session(View|Out|Info)|Append(Answer|Out)|TurnResult|"
                             r"Resume(Answer|Out|View))$")
SERVICES = "memkv/protocol/services.py"

LEAVES = {"errors", "gpu_kernels", "native", "periodic"}
#: What each floor may import from memkv (its own package always).
ALLOWED: dict[str, set[str]] = {
    "protocol": {"errors"},
    "storage": {"protocol"} | LEAVES,
    "shm": {"protocol", "storage"} | LEAVES,
    "router": {"protocol", "storage", "shm"} | LEAVES,
    "device": {"protocol", "storage", "shm"} | LEAVES,
    "archive": {"protocol", "storage", "shm"} | LEAVES,
}


def _modules() -> Iterator[tuple[str, Path]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(ROOT).as_posix(), path


def _imports(tree: ast.AST, top_level: bool = False) -> Iterator[tuple[int, str]]:
    """``(line, module)`` of every import in ``tree``, nested ones included unless
    ``top_level`` (what loading the module loads)."""
    nodes = ast.iter_child_nodes(tree) if top_level else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module


def _type_checking_lines(tree: ast.AST) -> set[int]:
    """Lines under ``if TYPE_CHECKING:`` (imports for annotations only: nothing loads)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) \
                and node.test.id == "TYPE_CHECKING":
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def check_sizes(rel: str, text: str) -> Iterator[str]:
    lines = text.count("\n")
    if lines > MAX_MODULE_LINES and rel not in LONG_MODULES_ALLOWED:
        yield f"{rel}: {lines} lines (at most {MAX_MODULE_LINES}: split it by idea)"


def check_floors(rel: str, tree: ast.AST) -> Iterator[str]:
    parts = rel.split("/")
    floor = parts[1] if len(parts) > 2 else ""
    allowed = ALLOWED.get(floor)
    if allowed is None:
        return
    annotations_only = _type_checking_lines(tree)
    if floor == "protocol":  # loading it loads neither (a function may, for its caller)
        for line, module in _imports(tree, top_level=True):
            if module.split(".")[0] in ("torch", "ray"):
                yield f"{rel}:{line}: protocol loads {module} (the shared vocabulary: plain values)"
    for line, module in _imports(tree):
        if line in annotations_only:
            continue
        top = module.split(".")[0]
        if top != "memkv":
            continue
        target = module.split(".")[1] if "." in module else ""
        if target and target != floor and target not in allowed:
            yield (f"{rel}:{line}: {floor} imports memkv.{target} (it may import "
                   f"{', '.join(sorted(allowed))})")


def check_blocking_gets(rel: str, tree: ast.AST) -> Iterator[str]:
    if not rel.startswith("memkv/actors/"):
        return
    for node in ast.walk(tree):
        if not isinstance(node, ast.AsyncFunctionDef):
            continue
        for inner in ast.walk(node):
            if (isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute)
                    and inner.func.attr == "get" and isinstance(inner.func.value, ast.Name)
                    and inner.func.value.id == "ray"):
                yield (f"{rel}:{inner.lineno}: ray.get inside async {node.name}() blocks the "
                       "actor's event loop (await the reference)")


def check_one_declaration(rel: str, tree: ast.AST) -> Iterator[str]:
    if rel == SERVICES:
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and ONE_DECLARATION.match(node.name):
            yield (f"{rel}:{node.lineno}: class {node.name} declares again what "
                   f"{SERVICES} declares (serve or decode that struct)")


def main() -> int:
    problems: list[str] = []
    api_remote = 0
    header_gets = 0
    edge_dicts = 0
    remote = re.compile(r"\.remote\(")
    for rel, path in _modules():
        text = path.read_text()
        tree = ast.parse(text, filename=rel)
        problems += check_sizes(rel, text)
        problems += check_floors(rel, tree)
        problems += check_blocking_gets(rel, tree)
        problems += check_one_declaration(rel, tree)
        code = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
        if rel.startswith("memkv/api/"):
            api_remote += sum(len(remote.findall(line)) for line in code)
        if rel == "memkv/cluster/memkv_cluster.py":
            for line in code:
                if remote.search(line):
                    problems.append(f"{rel}: a raw .remote( call ({line.strip()[:60]}): "
                                    "use a typed handle (memkv.actors.handles)")
        if not rel.startswith("memkv/protocol/"):
            header_gets += sum(line.count("header.get(") for line in code)
        if rel.startswith(("memkv/actors/", "memkv/api/", "memkv/cluster/")):
            edge_dicts += sum(line.count("dict[str, Any]") for line in code)
    if api_remote > MAX_API_REMOTE:
        problems.append(f"memkv/api: {api_remote} raw .remote( calls (at most {MAX_API_REMOTE}, "
                        "the worker actors' start and stop): use a typed handle")
    if header_gets:
        problems.append(f"{header_gets} header.get( outside memkv/protocol: decode wire "
                        "headers into typed structs there (memkv.protocol.port, "
                        "memkv.protocol.frame_headers)")
    if edge_dicts > PROCESS_EDGE_DICT_ANY_CEILING:
        problems.append(f"{edge_dicts} dict[str, Any] in actors/api/cluster (ceiling "
                        f"{PROCESS_EDGE_DICT_ANY_CEILING}): type what crosses a process")
    for problem in problems:
        print(problem)
    if not problems:
        print(f"house check: ok ({api_remote} raw .remote( in the gateway, {header_gets} "
              f"header.get(, {edge_dicts} dict[str, Any] at the edges)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
