"""docs/design.md's folder tree names every module and package of omni_stream/, and nothing else.

The tree is the architecture document (docs/design.md, its first block,
the one that starts ``omni_stream/``), so it must not go stale: issue 34
found 16 modules and ``store/`` missing from it. How it is read:

- ``name.py`` is a module; ``name/`` (or ``a/b/``) a folder;
- a folder at the start of a line indented two spaces opens a section;
  a module there (``  cli.py``) is at the top of the package;
- a folder named further into a section is inside the section's folder,
  and the modules after it are its own (``models/ ... diffusers/ base.py``);
- text in parentheses is commentary, even across lines, and other words
  (``the public core, no I/O``) are ignored;
- a package's ``__init__.py`` is its folder's name; every other ``.py``
  file, ``__main__.py`` included, is named.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "omni_stream"
DESIGN = ROOT / "docs" / "design.md"

_MODULE = re.compile(r"[A-Za-z_]\w*\.py")
_FOLDER = re.compile(r"[A-Za-z_]\w*(?:/[A-Za-z_]\w*)*/")


def tree_block(markdown: str) -> str:
    """The first fenced block whose first line is ``omni_stream/``."""
    match = re.search(r"^```[^\n]*\nomni_stream/\n(.*?)^```", markdown, re.MULTILINE | re.DOTALL)
    assert match, "docs/design.md has no fenced block starting with the line 'omni_stream/'"
    return match.group(1)


def tree_names(block: str) -> list[str]:
    """Every module and folder the tree names, as paths under omni_stream/ (folders end in '/')."""
    # Blank out parenthesised commentary, keeping the newlines so lines stay lines.
    block = re.sub(r"\([^()]*\)", lambda m: re.sub(r"[^\n]", " ", m.group()), block)
    names: list[str] = []
    section = ""  # the folder of the current section ("" for the package's top)
    folder = ""  # where a module named now lives
    for line in block.splitlines():
        stripped = line.lstrip(" ")
        opens_section = len(line) - len(stripped) == 2
        for position, token in enumerate(stripped.split()):
            if _FOLDER.fullmatch(token):
                if opens_section and position == 0:
                    section = folder = token
                else:
                    folder = section + token
                parts = folder.rstrip("/").split("/")
                names += ["/".join(parts[: i + 1]) + "/" for i in range(len(parts))]
            elif _MODULE.fullmatch(token):
                if opens_section and position == 0:
                    section = folder = ""
                names.append(folder + token)
    return names


def package_names(package: Path) -> set[str]:
    """Every module (but ``__init__.py``) and every folder holding one, under ``package``."""
    names: set[str] = set()
    for path in package.rglob("*.py"):
        relative = path.relative_to(package)
        if "__pycache__" in relative.parts:
            continue
        folders = relative.parts[:-1]
        names.update("/".join(folders[: i + 1]) + "/" for i in range(len(folders)))
        if path.name != "__init__.py":
            names.add(relative.as_posix())
    return names


def test_the_tree_reader_follows_sections_subfolders_and_commentary():
    block = (
        "  a.py  b.py (words b.py\n"
        "             c.py) d.py\n"
        "  pkg/     e.py  no I/O: f.py\n"
        "           sub/  g.py (x) h.py\n"
        "  two/deep/  i.py\n"
        "  j.py\n"
    )
    assert tree_names(block) == [
        "a.py", "b.py", "d.py", "pkg/", "pkg/e.py", "pkg/f.py", "pkg/", "pkg/sub/", "pkg/sub/g.py",
        "pkg/sub/h.py", "two/", "two/deep/", "two/deep/i.py", "j.py",
    ]


def test_the_package_reader_names_modules_and_folders_not_init(tmp_path):
    for name in ("__init__.py", "__main__.py", "a.py", "pkg/__init__.py", "pkg/sub/b.py",
                 "pkg/__pycache__/a.cpython-313.py", "static/index.html"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    assert package_names(tmp_path) == {"__main__.py", "a.py", "pkg/", "pkg/sub/", "pkg/sub/b.py"}


def test_design_md_tree_names_every_module_and_package_and_nothing_else():
    named = tree_names(tree_block(DESIGN.read_text(encoding="utf-8")))
    present = package_names(PACKAGE)
    missing = sorted(present - set(named))
    extra = sorted(set(named) - present)
    twice = sorted({name for name in named if not name.endswith("/") and named.count(name) > 1})
    problems = []
    if missing:
        problems.append(f"missing from the tree (add them, in their folder): {', '.join(missing)}")
    if extra:
        problems.append(f"named in the tree but not in omni_stream/: {', '.join(extra)}")
    if twice:
        problems.append(f"named twice: {', '.join(twice)}")
    assert not problems, "docs/design.md's folder tree is stale:\n" + "\n".join(problems)
