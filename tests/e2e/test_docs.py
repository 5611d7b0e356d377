"""Every ``python`` code block in README.md and docs/*.md runs, in its own processes.

An HTML comment on the line before a block says how (see docs/development.md):

* none: the block is a script, run in a fresh interpreter;
* ``<!-- docs-test: server -->``: first start the ``tensorx ps`` command of the nearest
  ``sh`` block above it, on a free loopback port; the block's ``tcp://127.0.0.1:7000`` is
  replaced by the address the server printed, and the server must then stop cleanly;
* ``<!-- docs-test: torchrun N -->``: run the block under ``torchrun --nproc-per-node N``;
* ``<!-- docs-test: skip REASON -->``: an illustration, not run (it must still compile);
* ``<!-- docs-test: service -->`` and ``<!-- docs-test: client -->``: a two-process service
  (docs/services.md): the service runs, the client runs against it, and the service is
  stopped and started again at the same address while the client runs.

A block that raises, exits non-zero or hangs fails its test.
"""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\S*)\s*$")
MARKER = re.compile(r"^<!--\s*docs-test:\s*(\w+)\s*(.*?)\s*-->$")
PLACEHOLDER = "tcp://127.0.0.1:7000"
MODES = ("script", "server", "torchrun", "skip", "service", "client")
BLOCK_TIMEOUT = 120.0


@dataclass(frozen=True)
class Block:
    path: Path
    line: int              # 1-based line of the opening fence
    lang: str
    code: str
    mode: str              # one of MODES
    arg: str               # the marker's argument (reason, process count)
    server: str | None     # the `tensorx ps` command a "server" block needs

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def stop_cleanly(proc: subprocess.Popen[str], name: str, failed: bool) -> None:
    """SIGTERM ``proc``, which must then stop within 30 s, and with status 0 unless the
    block it served ``failed`` already."""
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate(timeout=30)
        pytest.fail(f"{name} did not stop within 30 s of SIGTERM")
    if not failed:
        assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{err}"


def parse(path: Path) -> list[Block]:
    """The fenced blocks of one Markdown file, each with the marker just before it."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    last_ps: str | None = None
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        assert end is not None, f"{path.name}:{i + 1}: unclosed code block"
        code = "\n".join(lines[i + 1:end]) + "\n"
        mode, arg = _marker(lines, i)
        if fence.group(1) == "sh":
            last_ps = _ps_command(code) or last_ps
        blocks.append(Block(path, i + 1, fence.group(1), code, mode, arg,
                            last_ps if mode == "server" else None))
        i = end + 1
    return blocks


def _marker(lines: list[str], fence: int) -> tuple[str, str]:
    before = fence - 1
    while before >= 0 and not lines[before].strip():
        before -= 1
    found = MARKER.match(lines[before].strip()) if before >= 0 else None
    return (found.group(1), found.group(2)) if found else ("script", "")


def _ps_command(code: str) -> str | None:
    joined = code.replace("\\\n", " ")
    return next((line.strip() for line in joined.splitlines()
                 if line.strip().startswith("tensorx ps ")), None)


ALL = [b for path in DOCUMENTS for b in parse(path)]
PYTHON = [b for b in ALL if b.lang == "python"]
RUN = [b for b in PYTHON if b.mode in ("script", "server", "torchrun")]


def test_the_documents_have_blocks_to_run() -> None:
    assert {b.path.name for b in RUN} >= {"README.md", "getting-started.md", "porting.md"}


@pytest.mark.parametrize("block", PYTHON, ids=lambda b: b.id)
def test_every_python_block_is_marked_well_and_compiles(block: Block) -> None:
    assert block.mode in MODES, f"{block.id}: unknown docs-test marker {block.mode!r}"
    if block.mode == "skip":
        assert block.arg, f"{block.id}: a skipped block says why"
    if block.mode == "server":
        assert block.server is not None, f"{block.id}: no `tensorx ps` sh block above it"
        assert PLACEHOLDER in block.code, f"{block.id}: does not connect to {PLACEHOLDER}"
    compile(block.code, block.id, "exec")


@pytest.mark.timeout(3 * BLOCK_TIMEOUT)
@pytest.mark.parametrize("block", RUN, ids=lambda b: b.id)
def test_python_block_runs(block: Block, tmp_path: Path) -> None:
    script = tmp_path / "block.py"
    if block.mode == "server":
        assert block.server is not None
        with _Server(block.server) as address:
            script.write_text(block.code.replace(PLACEHOLDER, address))
            _run([sys.executable, str(script)], tmp_path, block)
    elif block.mode == "torchrun":
        script.write_text(block.code)
        _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
              "--nproc-per-node", block.arg or "2", str(script)], tmp_path, block)
    else:
        script.write_text(block.code)
        _run([sys.executable, str(script)], tmp_path, block)


SERVICES = [b for b in PYTHON if b.mode in ("service", "client")]


def test_the_service_page_runs_in_two_processes_through_a_restart(tmp_path: Path) -> None:
    """docs/services.md's service and client, each in its own process, as a reader runs
    them: the service is stopped (SIGTERM) and started again at its address while the
    client runs, and the client finishes every round having seen one restart."""
    pair = {b.mode: b for b in SERVICES if b.path.name == "services.md"}
    assert set(pair) == {"service", "client"}
    (tmp_path / "service.py").write_text(pair["service"].code)
    (tmp_path / "client.py").write_text(pair["client"].code)
    first = _Service(tmp_path, "tcp://127.0.0.1:0")
    with first:
        address = first.address
        client = subprocess.Popen([sys.executable, "client.py", address], cwd=tmp_path,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert client.stdout is not None
            line = _readline(client.stdout, BLOCK_TIMEOUT)
            assert line.startswith("table float32 (10000, 64)"), line
        except BaseException:
            client.kill()
            raise
    try:
        with _Service(tmp_path, address):
            out, err = client.communicate(timeout=BLOCK_TIMEOUT)
    finally:
        client.kill()
    assert client.returncode == 0, f"client.py exited {client.returncode}:\n{out}\n{err}"
    assert "the service restarted" in out and "done: 100 rounds, 1 restart(s)" in out, out


class _Service:
    """``python service.py LISTEN`` in ``cwd``, until SIGTERM, which it must take cleanly."""

    def __init__(self, cwd: Path, listen: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "service.py", listen], cwd=cwd,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.address = ""

    def __enter__(self) -> _Service:
        assert self.proc.stdout is not None
        line = _readline(self.proc.stdout, BLOCK_TIMEOUT)
        if not line.startswith("serving on "):
            self.proc.kill()
            pytest.fail(f"service.py did not start: {line!r}\n{self.proc.communicate()[1]}")
        self.address = line.split()[-1]
        return self

    def __exit__(self, *exc: object) -> None:
        stop_cleanly(self.proc, "service.py", failed=exc[0] is not None)


def _readline(stream: Any, timeout: float) -> str:
    """One line of ``stream``, or "" after ``timeout`` seconds."""
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return got[0] if got else ""


def _run(argv: list[str], cwd: Path, block: Block) -> None:
    try:
        done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True,
                              timeout=BLOCK_TIMEOUT, check=False)
    except subprocess.TimeoutExpired as exc:
        output = [o.decode() if isinstance(o, bytes) else o or "" for o in (exc.stdout, exc.stderr)]
        pytest.fail(f"{block.id} did not finish within {BLOCK_TIMEOUT} s:\n" + "\n".join(output))
    assert done.returncode == 0, (f"{block.id} exited {done.returncode}:\n{done.stdout}\n"
                                  f"{done.stderr}")


class _Server:
    """The block's ``tensorx ps`` command, on a free loopback port, for one test."""

    def __init__(self, command: str) -> None:
        args = shlex.split(command)[2:]
        if "--listen" in args:
            del args[args.index("--listen"):args.index("--listen") + 2]
        self.argv = [sys.executable, "-m", "tensorx.cli", "ps", "--listen",
                     "tcp://127.0.0.1:0", "--log-level", "WARNING", *args]
        self.proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> str:
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        first: list[str] = []
        reader = threading.Thread(target=lambda: first.append(self._stdout().readline()),
                                  daemon=True)
        reader.start()
        reader.join(BLOCK_TIMEOUT)
        line = first[0] if first else ""
        if "listening on" not in line:
            self.proc.kill()
            _, err = self.proc.communicate(timeout=30)
            pytest.fail(f"{shlex.join(self.argv)} did not start: {line!r}\n{err}")
        return line.split()[-1]

    def _stdout(self) -> Any:
        assert self.proc is not None and self.proc.stdout is not None
        return self.proc.stdout

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        stop_cleanly(self.proc, "tensorx ps", failed=exc[0] is not None)


def test_readme_links_resolve() -> None:
    """README's relative links (to docs/*.md, so that they work on GitHub) name real files."""
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [t for t in targets if "://" not in t]
    assert local, "README links to the docs"
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, f"README links to missing files: {missing}"


def test_the_api_reference_covers_the_public_surface() -> None:
    """Every name in ``tensorx.__all__`` has its entry in docs/api.md (errors: the module)."""
    import tensorx
    import tensorx.errors

    text = (ROOT / "docs" / "api.md").read_text()
    documented = set(re.findall(r"^::: tensorx\.(\w+)\s*$", text, re.MULTILINE))
    if "errors" in documented:
        documented |= set(tensorx.errors.__all__)
    missing = sorted(set(tensorx.__all__) - documented - {"__version__"})
    assert not missing, f"docs/api.md has no `::: tensorx.NAME` entry for {missing}"


REFERENCE = ROOT / "docs" / "reference.md"
SIGNATURE = re.compile(r"`(?:await )?([\w.]+)\(([^`]*)\)`")


def _reference_sections() -> dict[str, tuple[list[str], str]]:
    """docs/reference.md's ``### `Name` `` sections: title -> (the names it covers, text)."""
    parts = re.split(r"^(#{2,3} .*)$", REFERENCE.read_text(), flags=re.MULTILINE)
    return {title: (re.findall(r"`(\w+)`", title), text)
            for title, text in zip(parts[1::2], parts[2::2], strict=True)
            if title.startswith("### ") and "`" in title}


def test_the_readable_reference_covers_the_public_surface() -> None:
    """docs/reference.md has a section per public name (errors: a row of its table), and
    each class's section has an example that runs."""
    import inspect

    import tensorx

    sections = _reference_sections()
    covered = {name for names, _ in sections.values() for name in names}
    errors = REFERENCE.read_text().split("\n## Errors\n", 1)[1]
    covered |= set(re.findall(r"^\| `(\w+)`", errors, re.MULTILINE))
    missing = sorted(set(tensorx.__all__) - covered - {"__version__"})
    assert not missing, f"docs/reference.md has no section for {missing}"
    runs = {b.line for b in RUN if b.path == REFERENCE}
    starts = {title: REFERENCE.read_text().splitlines().index(title) + 1 for title in sections}
    for title, (names, text) in sections.items():
        if not inspect.isclass(getattr(tensorx, names[0])):
            continue
        first = starts[title]
        last = first + text.count("\n")
        assert any(first < line <= last for line in runs), f"{title}: no example that runs"


def _split_arguments(text: str) -> list[str]:
    depth, current, parts = 0, "", []
    for char in text:
        depth += char in "([{"
        depth -= char in ")]}"
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return [p.strip() for p in [*parts, current] if p.strip()]


def _documented(arguments: str) -> list[str]:
    return [re.split(r"[=:]", a, maxsplit=1)[0].strip() for a in _split_arguments(arguments)]


def _actual(obj: Any) -> list[str]:
    import inspect

    names: list[str] = []
    for p in inspect.signature(obj).parameters.values():
        if p.kind is p.KEYWORD_ONLY and "*" not in names and not any(
                n.startswith("*") for n in names):
            names.append("*")
        names.append({p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name)
    return names


def _signatures(text: str) -> list[tuple[str, str]]:
    """``(qualified name, arguments)`` of a section's signature blocks and of the first
    column of its table (the member)."""
    found = [s for row in re.findall(r"^\|([^|]+)\|", text, re.MULTILINE)
             for s in SIGNATURE.findall(row)]
    for block in re.findall(r"^```text\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
        for signature in re.split(r"\n(?=\S)", block.strip()):
            head = re.match(r"([\w.]+)\((.*)\)(?:\s*->.*)?$", " ".join(signature.split()))
            assert head, f"unreadable signature {signature!r}"
            found.append((head.group(1), head.group(2)))
    return found


def test_the_reference_signatures_match_the_code() -> None:
    """Every signature in docs/reference.md lists the parameters the code has, in order."""
    import tensorx

    checked, wrong = 0, []
    for title, (names, text) in _reference_sections().items():
        home = getattr(tensorx, names[0])
        for qualified, arguments in _signatures(text):
            head, *rest = qualified.split(".")
            obj = getattr(tensorx, head) if head in tensorx.__all__ else getattr(home, head)
            for part in rest:
                obj = getattr(obj, part)
            actual = [n for n in _actual(obj) if n not in ("self", "cls")]
            checked += 1
            if _documented(arguments) != actual:
                wrong.append(f"{title}: {qualified}({arguments}) but the code has {actual}")
    assert checked > 50
    assert not wrong, "\n".join(wrong)
