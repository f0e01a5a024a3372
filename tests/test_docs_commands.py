"""Every shell command in README.md and docs/*.md, run as a user runs it (issue 34).

**What is a command.** The ``bash``, ``sh`` and ``console`` blocks of
README.md and docs/*.md, read from the markdown when the tests are
collected (never copied here), so a doc that drifts from the CLI (an option
removed, a subcommand renamed) fails CI. In a ``bash``/``sh`` block every
line is a command (``\\`` at the end continues it, ``#`` starts a comment,
``a && b`` is two commands, run in turn); in a ``console`` block, the lines
after a ``$ `` prompt (the rest is what they printed).

**How it runs.** Each command is a process of its own (``bash -c``, so
quotes and ``$(...)`` mean what they mean in a terminal), in a fresh folder
for its block. Its exit status must be 0, and what it says it writes is
checked: ``generate``'s ``-o`` opens in PIL as the format its suffix
names, at ``--size``; its ``--previews`` are an animation of two or more
frames (or a folder of PNGs); ``curl -o`` writes an image PIL opens; any
other ``curl`` prints JSON, or an event stream that ends in ``done``.
``omni-stream serve`` (with ``&`` or not) starts in the background, must
say where it listens and answer ``/health`` with 200, serves the block's
later commands, and is stopped with SIGTERM at the block's end, exiting 0
(README.md). A block's ``generate`` and ``serve`` commands start side by
side, the others then run in order (:class:`BlockRun`), and all blocks run
at once: the time is the processes' imports (diffusers' most), ~65 CPU
seconds in all, so about 35 s on two cores of their own.

**What is not run** is marked in the doc, on the lines just above the
block, with the reason (README.md, "The docs are tests")::

    <!-- not run: REASON -->              every command of the block
    <!-- not run `PREFIX`: REASON -->     its commands that start with PREFIX

A marker that matches no command fails, as does a shell command in an
unlabelled block (it would be read by nobody). An ``omni-stream`` command
that is not run still has its subcommand and its options checked against
the CLI's parser, and so has README.md's synopsis (its ``text`` block).

**Substitutions**: :data:`SUBSTITUTIONS` below, the one table of them.

"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import pytest
from PIL import Image

from omni_stream import cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: Docs not read yet, and why: each is a change of its own to bring in.
NOT_READ: dict[str, str] = {}

#: What the docs name that cannot run here, what runs in its place, and why.
#: Applied in this order to the text of every command that runs; ``{name}``
#: is then a stand-in made here (``{tiny_sd}``...) or read from what ran
#: before it in its block (``{url}``, ``{id}``). Every row must be used.
SUBSTITUTIONS: tuple[tuple[str, str, str], ...] = (
    ("diffusers:stabilityai/stable-diffusion-2-1-base", "diffusers:{tiny_sd}",
     "a hub download; a tiny random-weight SD pipeline (tests/models/test_diffusers.py's "
     "text_sd_pipe, with its own tokenizer and text encoder) saved as from_pretrained reads it"),
    ("diffusers:./my-sd-folder", "diffusers:{tiny_sd}", "a folder the reader has; the same tiny SD"),
    ("diffusers:DIR", "diffusers:{tiny_sd}", "a placeholder; the same tiny SD"),
    ("madebyollin/taesd", "{tiny_taesd}",
     "a hub download; a tiny random-weight AutoencoderTiny (tests/models/test_diffusers_output.py)"),
    ("./ink.safetensors", "{ink}", "a LoRA file the reader has; a random LoRA for the tiny SD's "
     "attention (tests/models/test_diffusers_loras.py)"),
    ("./loras", "{loras}", "a folder of LoRAs the reader has; one holding pastel.safetensors, another"),
    ("diffusers:stabilityai/sd-turbo", "mixture",
     "a hub download, in commands that show scale-out (a device group, Ray replicas), not a "
     "pipeline; the embedded model, which keeps each member's and replica's start cheap"),
    ("--size 512", "--size 64", "the tiny SD at 512 px takes minutes on a CPU (attention over "
     "4,096 latent pixels); 64 px takes a second"),
    ("--device cuda:0,cuda:1", "--device cpu,cpu", "no GPU here; two CPU members make the same group"),
    ("--replicas 4", "--replicas 1", "four replicas do not fit on two cores"),
    ("--num-gpus 1", "--num-gpus 0", "no GPU here"),
    ("omni-stream serve", "omni-stream serve --port 0", "servers run side by side, and 8765 may be "
     "taken; the port each one says it listens on is then {url}"),
    ("http://127.0.0.1:8765", "{url}", "the address of the block's server (above)"),
    ("3f0c...", "{id}", "the id the block's first request was given (the JSON it printed)"),
    ("curl ", "curl --fail ", "curl exits 0 on an HTTP error without it"),
)

#: Seconds a command may run; a server may take to answer /health (a local Ray starting on two
#: busy cores included); a stopped server may take to exit.
COMMAND_S = 120.0
SERVE_START_S = 120.0
SERVE_STOP_S = 30.0

_FENCE = re.compile(r"^\s*```\s*([\w+-]*)")
_MARKER = re.compile(r"^<!-- not run(?: `(?P<prefix>[^`]+)`)?: (?P<reason>\S.*?) -->$")
_SHELL = ("bash", "sh", "shell", "console")
_LOOKS_LIKE_A_COMMAND = re.compile(r"^\s*(\$ |omni-stream |python3? |curl |pip3? |bash )")
_PLACEHOLDER = re.compile(r"\{(tiny_sd|tiny_taesd|ink|loras|url|id)\}")
_LISTENING = re.compile(r"listening on (http://\S+)")
_FORMATS = {".png": "PNG", ".jpg": "JPEG", ".jpeg": "JPEG", ".webp": "WEBP", ".gif": "GIF"}


# -- reading the docs ------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    text: str  # as the doc writes it: continuations joined, the comment and a trailing '&' cut
    background: bool  # it ended with '&'
    not_run: str | None  # the reason, when a marker says so


@dataclass(frozen=True)
class Block:
    doc: str  # relative to the repository: "docs/http.md"
    line: int  # the opening fence's line, 1-based
    lang: str
    body: tuple[str, ...]
    markers: tuple[tuple[str | None, str, int], ...]  # (prefix or None, reason, line)

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def commands(self) -> list[Command]:
        found = []
        for text in split_commands(logical_lines(self.body, console=self.lang == "console")):
            background = text.endswith("&") and not text.endswith("&&")
            text = text.removesuffix("&").rstrip() if background else text
            reason = next(
                (why for prefix, why, _ in self.markers if prefix is None or text.startswith(prefix)), None
            )
            found.append(Command(text, background, reason))
        return found


def read_blocks(path: Path) -> list[Block]:
    """Every fenced block of a markdown file, with the not-run markers just above it."""
    doc = path.relative_to(ROOT).as_posix()
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith("```"):
            end += 1
        markers, above = [], i - 1
        while above >= 0 and lines[above].startswith("<!-- not run"):
            marker = _MARKER.match(lines[above].strip())
            assert marker, (f"{doc}:{above + 1}: a marker reads '<!-- not run: REASON -->' or "
                            f"'<!-- not run `PREFIX`: REASON -->', not {lines[above]!r}")
            markers.append((marker["prefix"], marker["reason"], above + 1))
            above -= 1
        blocks.append(Block(doc, i + 1, fence.group(1).lower(), tuple(lines[i + 1 : end]), tuple(markers)))
        i = end + 1
    return blocks


def logical_lines(body: tuple[str, ...] | list[str], *, console: bool) -> list[str]:
    """The block's command lines: continuations joined; in a console block only the prompted ones."""
    out: list[str] = []
    lines = iter(body)
    for line in lines:
        if console:
            if not line.startswith("$ "):
                continue  # what a command printed
            line = line[2:]
        while True:
            if line.rstrip().endswith("\\"):
                line = line.rstrip()[:-1].rstrip() + " " + next(lines, "").strip()
            elif _open_quote(line):  # a quoted string goes on, newlines and all, as in a shell
                line += "\n" + next(lines, _open_quote(line))
            else:
                break
        out.append(line.strip())
    return out


def _open_quote(text: str) -> str:
    """The quote character left open at the end of ``text``, or ""."""
    quote = ""
    for c in text:
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
    return quote


def split_commands(lines: list[str]) -> list[str]:
    """Each line's commands: a comment cut, ``a && b`` split in two, quotes and ``$(...)`` respected."""
    commands = []
    for line in lines:
        parts, current, quote, depth, i = [], "", "", 0, 0
        while i < len(line):
            c = line[i]
            if quote:
                quote = "" if c == quote else quote
            elif c in "'\"":
                quote = c
            elif line.startswith("$(", i):
                depth += 1
            elif c == ")" and depth:
                depth -= 1
            elif not depth and c == "#" and (i == 0 or line[i - 1].isspace()):
                break
            elif not depth and line.startswith("&&", i):
                parts.append(current)
                current, i = "", i + 2
                continue
            current += c
            i += 1
        parts.append(current)
        commands += [part.strip() for part in parts if part.strip()]
    return commands


def all_blocks() -> list[Block]:
    return [block for path in DOCS if path.relative_to(ROOT).as_posix() not in NOT_READ
            for block in read_blocks(path)]


BLOCKS = all_blocks()
SHELL_BLOCKS = [block for block in BLOCKS if block.lang in _SHELL]
RUN_BLOCKS = [block for block in SHELL_BLOCKS if any(c.not_run is None for c in block.commands)]


# -- the checks that run nothing -------------------------------------------------------


def test_reading_a_block_joins_continuations_cuts_comments_and_splits_chains():
    body = [
        "# a comment line",
        "omni-stream serve --model mixture &     # http://127.0.0.1:8765",
        "curl -s -X POST http://x/v1 \\",
        "     -d '{\"a\": \"b # c && d\"}'",
        'pip install x && omni-stream serve --webhook-secret "$(python3 -c \'print(1)\')"  # note',
    ]
    block = Block("README.md", 1, "bash", tuple(body), (("pip install", "installs", 0),))
    assert block.commands == [
        Command("omni-stream serve --model mixture", True, None),
        Command("curl -s -X POST http://x/v1 -d '{\"a\": \"b # c && d\"}'", False, None),
        Command("pip install x", False, "installs"),
        Command('omni-stream serve --webhook-secret "$(python3 -c \'print(1)\')"', False, None),
    ]
    quoted = Block("docs/x.md", 1, "bash", ("curl -d '{", '  "a": 1', "}'", "ls"), ())
    assert [c.text for c in quoted.commands] == ["curl -d '{\n  \"a\": 1\n}'", "ls"]
    console = Block("docs/x.md", 1, "console", ("$ python -m a --b \\", "    --c", "output: 1", "$ ls"), ())
    assert [c.text for c in console.commands] == ["python -m a --b --c", "ls"]


def test_every_marker_sits_above_a_shell_block_and_matches_one_of_its_commands():
    problems = []
    for path in DOCS:
        doc = path.relative_to(ROOT).as_posix()
        if doc in NOT_READ:
            continue
        placed = {line for block in read_blocks(path) if block.lang in _SHELL for *_, line in block.markers}
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.startswith("<!-- not run") and number not in placed:
                problems.append(f"{doc}:{number}: a marker not directly above a bash/sh/console block")
    for block in SHELL_BLOCKS:
        for prefix, _, line in block.markers:
            if prefix is not None and not any(c.text.startswith(prefix) for c in block.commands):
                problems.append(f"{block.doc}:{line}: `{prefix}` starts none of the block's commands")
    assert not problems, "\n".join(problems)


def test_shell_commands_are_in_labelled_blocks():
    unlabelled = [
        f"{block.id}: {line.strip()!r}" for block in BLOCKS if not block.lang
        for line in block.body if _LOOKS_LIKE_A_COMMAND.match(line)
    ]
    assert not unlabelled, (
        "commands in a block without a language are run by no test: label it ```bash (or ```console "
        "for $-prompted runs with their output; ```text for a synopsis):\n" + "\n".join(unlabelled)
    )


def _option_problems(where: str, argv: list[str]) -> list[str]:
    """The subcommand and every option of an ``omni-stream`` command line, against the CLI's parser."""
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    words = [w for w in argv[1:] if w not in ("-v", "--verbose")]
    if not words or words[0] == "bench":  # bench hands everything to `python -m benchmarks`
        return []
    if words[0] not in sub.choices:
        return [f"{where}: no subcommand {words[0]!r} (omni-stream has {', '.join(sub.choices)})"]
    known = sub.choices[words[0]]._option_string_actions
    return [f"{where}: omni-stream {words[0]} has no option {word.split('=')[0]}"
            for word in words[1:]
            if re.match(r"--?[A-Za-z]", word) and word.split("=")[0] not in known]


def test_option_check_names_an_unknown_subcommand_or_option():
    assert _option_problems("x", shlex.split("omni-stream serve --ray --replicas N --port=0")) == []
    assert _option_problems("x", ["omni-stream", "-v", "generate", "p", "--seed", "-1", "-o", "a.png"]) == []
    assert _option_problems("x", ["omni-stream", "serv", "--ray"]) == [
        "x: no subcommand 'serv' (omni-stream has generate, serve, models, bench)"]
    assert _option_problems("x", ["omni-stream", "generate", "--replicas", "2", "--out=a.png"]) == [
        "x: omni-stream generate has no option --replicas", "x: omni-stream generate has no option --out"]


def test_commands_not_run_name_only_subcommands_and_options_the_cli_has():
    problems = []
    for block in SHELL_BLOCKS:
        for command in block.commands:
            if command.not_run is not None and command.text.startswith("omni-stream "):
                problems += _option_problems(block.id, shlex.split(command.text))
    assert not problems, "\n".join(problems)


def test_the_readme_synopsis_names_only_subcommands_and_options_the_cli_has():
    synopses = [b for b in BLOCKS if b.doc == "README.md" and b.lang == "text"
                and b.body and b.body[0].startswith("omni-stream ")]
    assert synopses, "README.md has no ```text block of `omni-stream ...` usage lines"
    # One usage per line that starts `omni-stream SUBCOMMAND`; the indented lines after it are its own.
    usages: list[list[str]] = []
    for line in synopses[0].body:
        line = line.split("#")[0]
        if line.startswith("omni-stream "):
            usages.append(line.split()[:2])
            line = " ".join(line.split()[2:])
        usages[-1] += re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", line)
    problems = [problem for argv in usages for problem in _option_problems("README.md's synopsis", argv)]
    assert not problems, "\n".join(problems)


def test_every_substitution_is_used_by_a_command_that_runs():
    texts = [c.text for block in RUN_BLOCKS for c in block.commands if c.not_run is None]
    unused = [doc for doc, _, _ in SUBSTITUTIONS if not any(doc in text for text in texts)]
    assert not unused, f"SUBSTITUTIONS rows no command that runs uses (remove them): {unused}"


# -- running them ----------------------------------------------------------------


def substitute(text: str) -> str:
    for doc, ours, _ in SUBSTITUTIONS:
        text = text.replace(doc, ours)
    return text


def _environment() -> dict[str, str]:
    """A user's: this Python's scripts first on PATH, none of omni_stream's variables, no Ray address."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_STREAM_") and k != "RAY_ADDRESS"}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["HF_HUB_OFFLINE"] = "1"  # a hub name the table missed fails at once instead of waiting on a network
    return env


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: what it started, nothing else


@dataclass
class Server:
    command: str
    proc: subprocess.Popen[bytes]
    log: Path
    url: str = ""

    def output(self) -> str:
        return self.log.read_text(errors="replace")


class BlockRun:
    """One block's commands, in its own folder.

    ``omni-stream generate`` and ``serve`` commands start at once, side by
    side: they read only what the docs give them and each writes its own
    files (a block that made one read another's would have to say so here).
    The others then run in the block's order, ``{url}`` being the server
    started last before them in the doc, ``{id}`` the first id printed.
    """

    def __init__(self, block: Block, folder: Path, values: dict[str, str]) -> None:
        self.block = block
        self.folder = folder
        self.values = dict(values)
        self.env = _environment()
        self.servers: dict[int, Server] = {}  # by the command's place in the block
        self.transcript: dict[int, str] = {}

    def report(self) -> str:
        return "\n".join(self.transcript[number] for number in sorted(self.transcript))

    def fail(self, message: str) -> NoReturn:
        raise AssertionError(f"{self.block.id}: {message}\nthe block's commands so far:\n{self.report()}")

    def fill(self, number: int, command: Command) -> str:
        def value(match: re.Match[str]) -> str:
            name = match.group(1)
            before = [n for n, server in self.servers.items() if n < number and server.url]
            if name == "url" and before:
                return self.servers[max(before)].url
            if name != "url" and name in self.values:
                return self.values[name]
            self.fail(f"{command.text!r} needs {{{name}}}, and nothing before it in its block gave one")

        return _PLACEHOLDER.sub(value, substitute(command.text))

    def run(self) -> None:
        at_once, in_order = [], []
        for number, command in enumerate(self.block.commands):
            text = substitute(command.text)
            if command.not_run is not None:
                self.transcript[number] = f"  not run: {command.text}  ({command.not_run})"
            elif text.startswith(("omni-stream generate ", "omni-stream serve")) and not re.search(
                    r"\{(url|id)\}", text):
                at_once.append(number)
            elif command.background:
                self.fail(f"{command.text!r}: only `omni-stream serve` may run in the background here")
            else:
                in_order.append(number)
        try:
            with ThreadPoolExecutor(max_workers=max(1, len(at_once))) as pool:
                started = [pool.submit(self.run_one, number) for number in at_once]
                for future in started:
                    future.result()
            for number in in_order:
                self.run_one(number)
        finally:
            self.stop_servers()

    def run_one(self, number: int) -> None:
        command = self.block.commands[number]
        text = self.fill(number, command)
        if text.startswith("omni-stream serve"):
            self.start_server(number, command, text)
        else:
            self.run_command(number, command, text)

    def run_command(self, number: int, command: Command, text: str) -> None:
        started = time.monotonic()
        proc = subprocess.Popen(["bash", "-c", text], cwd=self.folder, env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=COMMAND_S)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, err = proc.communicate()
            self.fail(f"{command.text!r} (run as {text!r}) still ran after {COMMAND_S:.0f} s:\n"
                      f"{_tail(err.decode(errors='replace'))}")
        stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
        took = time.monotonic() - started
        self.transcript[number] = f"  ran ({took:.1f} s, exit status {proc.returncode}): {text}"
        if proc.returncode != 0:
            self.fail(f"{command.text!r} (run as {text!r}) exited {proc.returncode}:\n"
                      f"{_tail(stderr)}\n{_tail(stdout, 5)}")
        problem = check_outputs(shlex.split(text), self.folder, stdout)
        if problem:
            self.fail(f"{command.text!r} (run as {text!r}) exited 0, but {problem}\n"
                      f"its stderr:\n{_tail(stderr)}")
        if "id" not in self.values:
            try:
                answer = json.loads(stdout)
            except ValueError:
                return
            if isinstance(answer, dict) and isinstance(answer.get("id"), str):
                self.values["id"] = answer["id"]

    def start_server(self, number: int, command: Command, text: str) -> None:
        started = time.monotonic()
        log = self.folder.parent / f"{self.folder.name}-serve-{number}.log"
        with log.open("wb") as sink:
            proc = subprocess.Popen(["bash", "-c", "exec " + text], cwd=self.folder, env=self.env,
                                    stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        server = self.servers[number] = Server(text, proc, log)
        deadline = started + SERVE_START_S
        url = ""
        while not url:
            listening = _LISTENING.search(server.output())
            if listening:
                url = listening.group(1)
            elif proc.poll() is not None:
                self.fail(f"{command.text!r} (run as {text!r}) exited {proc.returncode} before it listened:\n"
                          f"{_tail(server.output())}")
            elif time.monotonic() > deadline:
                self.fail(f"{command.text!r} did not say where it listens within {SERVE_START_S:.0f} s:\n"
                          f"{_tail(server.output())}")
            else:
                time.sleep(0.1)
        status = None
        while status != 200:
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as answer:
                    status = answer.status
            except urllib.error.HTTPError as exc:
                status = exc.code  # 503 while it starts; a dead engine stays so
            except OSError:
                status = None
            if status != 200:
                if proc.poll() is not None or time.monotonic() > deadline:
                    self.fail(f"{command.text!r} listens on {url} but /health answered {status}:\n"
                              f"{_tail(server.output())}")
                time.sleep(0.2)
        server.url = url
        self.transcript[number] = (f"  serving ({time.monotonic() - started:.1f} s to /health 200) on {url}: "
                                   f"{text}")

    def stop_servers(self) -> None:
        problems = []
        for number in sorted(self.servers, reverse=True):
            server = self.servers[number]
            if server.proc.poll() is None:
                server.proc.send_signal(signal.SIGTERM)
            try:
                server.proc.wait(timeout=SERVE_STOP_S)
            except subprocess.TimeoutExpired:
                problems.append(f"{server.command!r} still ran {SERVE_STOP_S:.0f} s after SIGTERM")
            _kill_group(server.proc)
            status = server.proc.wait()
            if number in self.transcript:
                self.transcript[number] += f"\n    stopped with SIGTERM: exit status {status}"
            if status != 0 and server.url and not problems:
                problems.append(f"{server.command!r} exited {status} after SIGTERM, not 0:\n"
                                f"{_tail(server.output())}")
        if problems:
            self.fail("\n".join(problems))


def check_outputs(argv: list[str], folder: Path, stdout: str) -> str | None:
    """What a command said it writes, checked; a sentence saying what is wrong, or None."""
    if argv[:2] == ["omni-stream", "generate"]:
        args = cli.build_parser().parse_args(argv[1:])
        out = Path(args.output)
        names = [out] if (args.num_images or 1) == 1 else [
            out.with_name(f"{out.stem}-{i}{out.suffix}") for i in range(args.num_images)]
        for name in names:
            problem = check_image(folder / name, args.size)
            if problem:
                return problem
        return check_previews(folder / args.previews) if args.previews else None
    if argv[:1] == ["curl"]:
        written = next((argv[i + 1] for i, word in enumerate(argv[:-1]) if word in ("-o", "--output")), None)
        if written:
            return check_image(folder / written, None)
        if any("text/event-stream" in word or word.endswith("/events") for word in argv):
            if "event: done" not in stdout:
                return f"its event stream has no 'event: done':\n{stdout[-500:]}"
            return None
        try:
            json.loads(stdout)
        except ValueError:
            return f"it printed no JSON: {stdout[:300]!r}"
    return None


def check_image(path: Path, size: int | None) -> str | None:
    if not path.is_file():
        return f"it wrote no {path.name}"
    if path.suffix.lower() == ".mp4":
        return None if path.read_bytes()[4:8] == b"ftyp" else f"{path.name} is not an MP4"
    expected = _FORMATS.get(path.suffix.lower())
    try:
        with Image.open(path) as image:
            found, found_size = image.format, image.size
    except OSError as exc:
        return f"PIL cannot open {path.name}: {exc}"
    if expected and found != expected:
        return f"{path.name} is {found}, not {expected}"
    if size and found_size != (size, size):
        return f"{path.name} is {found_size[0]}x{found_size[1]}, not {size}x{size}"
    return None


def check_previews(path: Path) -> str | None:
    if not path.suffix:  # a folder of numbered PNGs
        frames = sorted(path.glob("*.png")) if path.is_dir() else []
        if len(frames) < 2:
            return f"{path.name}/ holds {len(frames)} PNGs, not one per previewed step"
        return next(filter(None, (check_image(frame, None) for frame in frames)), None)
    problem = check_image(path, None)
    if problem or path.suffix.lower() == ".mp4":
        return problem
    with Image.open(path) as image:
        frames = getattr(image, "n_frames", 1)
    return None if frames >= 2 else f"{path.name} has {frames} frame, not one per previewed step"


def test_output_checks_catch_a_missing_file_a_wrong_format_or_size_and_an_unfinished_stream(tmp_path):
    Image.new("RGB", (64, 64)).save(tmp_path / "a.png")
    Image.new("RGB", (64, 64)).save(tmp_path / "b.png", format="JPEG")
    frames = [Image.new("RGB", (8, 8), color) for color in ("red", "blue")]
    frames[0].save(tmp_path / "p.gif", save_all=True, append_images=frames[1:])
    frames[0].save(tmp_path / "one.gif")
    generate = ["omni-stream", "generate", "x", "--size", "64", "-o"]
    assert check_outputs([*generate, "a.png", "--previews", "p.gif"], tmp_path, "") is None
    assert check_outputs([*generate, "b.png"], tmp_path, "") == "b.png is JPEG, not PNG"
    assert check_outputs([*generate[:3], "--size", "32", "-o", "a.png"], tmp_path, "") == (
        "a.png is 64x64, not 32x32")
    assert check_outputs([*generate, "c.png"], tmp_path, "") == "it wrote no c.png"
    assert check_outputs([*generate, "a.png", "--previews", "one.gif"], tmp_path, "") == (
        "one.gif has 1 frame, not one per previewed step")
    assert check_outputs([*generate, "a.png", "--previews", "steps/"], tmp_path, "") == (
        "steps/ holds 0 PNGs, not one per previewed step")
    events = ["curl", "-s", "http://h/v1/generations/x/events"]
    assert check_outputs(events, tmp_path, "event: done\n") is None
    assert "has no 'event: done'" in check_outputs(events, tmp_path, "event: progress\n")
    assert check_outputs(["curl", "http://h/v1/g"], tmp_path, "<html>") == "it printed no JSON: '<html>'"
    assert check_outputs(["curl", "-s", "http://h/", "-o", "d.png"], tmp_path, "") == "it wrote no d.png"


def make_stand_ins(folder: Path) -> dict[str, str]:
    """The files the substitutions name: a tiny SD, a tiny autoencoder, a LoRA, a folder of one."""
    pytest.importorskip("diffusers")
    pytest.importorskip("peft")
    from .conftest import one_torch_thread
    from .models.test_diffusers import text_sd_pipe
    from .models.test_diffusers_loras import make_lora
    from .models.test_diffusers_output import tiny_taesd

    folder.mkdir()
    with one_torch_thread():
        text_sd_pipe(folder).save_pretrained(folder / "sd")
        tiny_taesd().save_pretrained(folder / "taesd")
        (folder / "loras").mkdir()
        for seed, name in enumerate(("ink.safetensors", "loras/pastel.safetensors"), 7):
            made = make_lora(folder / f"lora-{seed}", seed)
            (made / "pytorch_lora_weights.safetensors").rename(folder / name)
    return {"tiny_sd": str(folder / "sd"), "tiny_taesd": str(folder / "taesd"),
            "ink": str(folder / "ink.safetensors"), "loras": str(folder / "loras")}


def _needs_stand_ins(block: Block) -> bool:
    texts = [substitute(c.text) for c in block.commands if c.not_run is None]
    return any(name in text for text in texts for name in ("{tiny_sd}", "{tiny_taesd}", "{ink}", "{loras}"))


def _selected(request: pytest.FixtureRequest) -> list[Block]:
    """The blocks whose test this session runs (``-k`` and node ids respected)."""
    chosen = {item.callspec.params["block"].id for item in request.session.items
              if getattr(item, "originalname", "") == "test_doc_commands_run" and hasattr(item, "callspec")}
    return [block for block in RUN_BLOCKS if block.id in chosen]


@pytest.fixture(scope="module")
def block_runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Future[str]]]:
    """Every selected block, started at once on threads (they wait on processes); its id -> its run."""
    root = tmp_path_factory.mktemp("docs")
    selected = _selected(request)
    needing = [block for block in selected if _needs_stand_ins(block)]
    futures: dict[str, Future[str]] = {}
    zero = time.monotonic()

    def run(block: Block, values: dict[str, str]) -> str:
        folder = root / re.sub(r"\W", "_", block.id)
        folder.mkdir()
        runner = BlockRun(block, folder, values)
        began = time.monotonic() - zero
        runner.run()
        return "\n".join([runner.report(), f"  (the block ran from +{began:.1f} s to "
                          f"+{time.monotonic() - zero:.1f} s of all the blocks' run)"])

    # serve --ray first: the longest, a local Ray starting.
    selected.sort(key=lambda block: not any("--ray" in c.text for c in block.commands))
    with ThreadPoolExecutor(max_workers=max(1, len(selected))) as pool:
        for block in selected:
            if block not in needing:
                futures[block.id] = pool.submit(run, block, {})
        if needing:
            try:
                values = make_stand_ins(root / "stand-ins")
            except (Exception, pytest.skip.Exception) as exc:  # no diffusers (a skip), or a failure
                for block in needing:
                    futures[block.id] = Future()
                    futures[block.id].set_exception(exc)
            else:
                for block in needing:
                    futures[block.id] = pool.submit(run, block, values)
        yield futures


def _missing(block: Block) -> str | None:
    """What a block needs that this machine lacks (a skip, saying so), or None."""
    texts = [c.text for c in block.commands if c.not_run is None]
    if any(text.startswith("curl ") for text in texts) and not shutil.which("curl"):
        return "needs curl"
    if any(" --ray" in text for text in texts) and importlib.util.find_spec("ray") is None:
        return "needs Ray Serve: pip install 'omni-stream[ray]'"
    return None


@pytest.mark.parametrize("block", RUN_BLOCKS, ids=[block.id for block in RUN_BLOCKS])
def test_doc_commands_run(block: Block, block_runs: dict[str, Future[str]]) -> None:
    missing = _missing(block)
    if missing:
        pytest.skip(missing)
    print(block_runs[block.id].result())  # what ran, and how long it took (pytest -rP shows it)
