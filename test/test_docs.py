"""The documentation's code runs, and the API reference lists every public name.

``make docs`` checks the same examples with Sphinx's doctest builder; these tests run them under
pytest, so that ``make test`` (and CI) catches a page whose example broke without Sphinx
installed.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import textwrap
from pathlib import Path

import pytest

import torchrl_grpo
from torchrl_grpo import advantages, loss_terms

DOCS = Path(__file__).resolve().parent.parent / "docs"
PAGES_WITH_TESTCODE = [
    "quickstart.rst",
    "concepts.rst",
    "migration.rst",
    "variants.rst",
    "loss.rst",
    "your_own_task.rst",
    "tutorial_multiturn.rst",
    "tutorial_distill.rst",
    "code.rst",
]
DIRECTIVE = re.compile(r"^\.\. (testcode|testoutput)::\s*(\S*)\s*$")


def _directives(text: str) -> list[tuple[str, str, str]]:
    """``(kind, group, body)`` of every ``testcode`` / ``testoutput`` block, in page order."""
    lines = text.splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        match = DIRECTIVE.match(lines[i])
        i += 1
        if not match:
            continue
        while i < len(lines) and re.match(r"^\s+:\w[\w-]*:", lines[i]):  # options
            i += 1
        body = []
        while i < len(lines) and (not lines[i].strip() or lines[i].startswith(" ")):
            body.append(lines[i])
            i += 1
        kind, group = match.groups()
        blocks.append((kind, group or "default", textwrap.dedent("\n".join(body)).strip("\n")))
    return blocks


def _normalize(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("page", PAGES_WITH_TESTCODE)
def test_page_examples_run(page):
    """Every ``testcode`` block runs, and prints what the following ``testoutput`` says."""
    blocks = _directives((DOCS / page).read_text(encoding="utf-8"))
    assert any(kind == "testcode" for kind, _, _ in blocks), f"no testcode in {page}"
    namespaces: dict[str, dict] = {}
    printed = ""
    for kind, group, body in blocks:
        if kind == "testcode":
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                code = compile(body, f"{page}[{group}]", "exec", dont_inherit=True)  # as Sphinx
                exec(code, namespaces.setdefault(group, {}))
            printed = out.getvalue()
        else:
            assert _normalize(printed) == _normalize(body), f"{page}[{group}]"


def test_quickstart_is_short():
    """The quick start's path from the buffer to the loss stays about fifteen lines of code."""
    (code,) = [
        b for k, _, b in _directives((DOCS / "quickstart.rst").read_text()) if k == "testcode"
    ]
    statements = [
        line
        for line in code.splitlines()
        if line.strip() and not line.lstrip().startswith(("#", "import ", "from "))
    ]
    assert len(statements) <= 20, len(statements)


def test_api_reference_documents_every_public_name():
    """``docs/api.rst`` has an autodoc entry for each name of ``torchrl_grpo.__all__``."""
    text = (DOCS / "api.rst").read_text(encoding="utf-8")
    documented = set(
        re.findall(r"^\.\. auto(?:class|function):: torchrl_grpo\.(\w+)\s*$", text, re.M)
    )
    for module in (advantages, loss_terms):
        match = re.search(
            rf"^\.\. automodule:: {module.__name__}\n((?:   .*\n)+)", text, flags=re.M
        )
        assert match, f"{module.__name__} is not autodoc'd in api.rst"
        members = re.search(r":members:(.*)", match.group(1))
        assert members, f"{module.__name__} is autodoc'd without its members"
        names = members.group(1).replace(",", " ").split()  # none listed: every name of __all__
        documented |= set(names or module.__all__)
    missing = sorted(set(torchrl_grpo.__all__) - documented)
    assert not missing, f"public names without an entry in docs/api.rst: {missing}"


# --- the files and modules that docs, docstrings and comments name exist -----------------------

ROOT = DOCS.parent
FOLDERS = ("torchrl_grpo", "test", "docs", "examples", "benchmarks")
TEXTS = sorted(
    [*DOCS.glob("*.rst"), ROOT / "README.md", ROOT / "Makefile"]
    + [path for folder in FOLDERS[:1] + FOLDERS[1:] for path in (ROOT / folder).rglob("*.py")]
)
FILE = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.(?:py|rst|md))\b")
MODULE = re.compile(r"\btorchrl_grpo(?:\.\w+)+")


def _named_files(path: Path):
    for match in FILE.finditer(path.read_text(encoding="utf-8")):
        yield match.group(1)


def _exists(name: str) -> bool:
    """Whether a file the text names exists: a path from the repository's root or from the
    package, a test file anywhere under ``test/``, a page of ``docs/``. Other bare names
    (``ppo.py``, ``conftest.py``) name files of torchrl or pytest, and are not checked."""
    if "/" in name:
        return any((base / name).exists() for base in (ROOT, ROOT / "torchrl_grpo", ROOT / "test"))
    if name.startswith("test_") and name.endswith(".py"):
        return any((ROOT / "test").rglob(name))
    if name.endswith(".rst"):
        return (DOCS / name).exists()
    return True


def _resolves(dotted: str) -> bool:
    """Whether a dotted name of this package is a module, or an attribute of one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(obj, attribute):
                return False
            obj = getattr(obj, attribute)
        return True
    return False


def test_named_files_exist():
    missing = sorted(
        {
            f"{path.relative_to(ROOT)}: {name}"
            for path in TEXTS
            for name in _named_files(path)
            if not _exists(name)
        }
    )
    assert not missing, missing


def test_named_modules_exist():
    missing = sorted(
        {
            f"{path.relative_to(ROOT)}: {name}"
            for path in TEXTS
            for name in MODULE.findall(path.read_text(encoding="utf-8"))
            if not _resolves(name.rstrip("."))
        }
    )
    assert not missing, missing


def test_your_own_task_is_the_short_path():
    """docs/your_own_task.rst shows the whole Acrobot script, shorter than the CartPole demo,
    and explains every line the script marks as a decision."""
    root = DOCS.parent
    script = (root / "examples" / "acrobot_grpo.py").read_text().splitlines()
    demo = (root / "examples" / "cartpole_grpo.py").read_text().splitlines()
    assert len(script) < len(demo) / 2
    page = (DOCS / "your_own_task.rst").read_text()
    assert ".. literalinclude:: ../examples/acrobot_grpo.py" in page
    assert f"({len(script)} lines against the CartPole example's {len(demo)})" in page
    decisions = re.findall(r"# DECISION (\w[\w ]*):", "\n".join(script))
    assert len(decisions) == 4
    for decision in decisions:  # "group size", "return mode", ...
        assert f"**{decision.capitalize()}**" in page, decision
