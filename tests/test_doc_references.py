"""References that resolve: every repository path named in the docs, in code comments and docstrings, in the protos,
the manifests, the Makefile and the Dockerfile exists; every cited section of a markdown file is one of its headings;
and neither the docs nor the packages narrate the project's development history.

Citation forms checked (the project's own): `docs/NAME.md, "Section"` (or `'Section'`, or without the comma), whose
text must begin a heading of that file; `docs/NAME.md#anchor` and markdown links `[text](path.md#anchor)`, whose
anchor must be the GitHub slug of one of its headings.

A path is a token with a `/` whose first segment is a top-level entry of the repository (`specdec/decoding/verify.py`,
`deploy/base/draft/hpa.yaml`), or a markdown link target. Allowed explicitly: braces expand
(`deploy/base/{draft,target}/hpa.yaml`), globs (`*`) must match something, and a token with a placeholder segment
(`WORK/online/NAME/`, `<id>`, `$VAR`, `...`) or under a git-ignored output folder (`.cache-pacer/`, `bench-results/`)
is not a path of the repository, nor is a Kubernetes object (`deploy/specdec-draft` in a kubectl command). A .proto
file's imports are relative to `proto/`. A path that no longer exists may still be cited in the same paragraph as a
commit that holds it (`` `5d26e82` ``): that reference resolves in git.
"""
from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("specdec", "coordinator", "draft_service", "target_service", "specdec_rpc", "specdec_bench",
            "specdec_train", "specdec_cli")
HISTORY = re.compile(r"session ?[0-9]+|\bs[0-9]{2}\b", re.I)
TEXT_SUFFIXES = {".py", ".md", ".proto", ".yaml", ".yml", ".json", ".toml", ".txt", ".c", ".h", ".jinja", ".env",
                 ".cfg", ".ini", ".sh"}
# the changelog records what changed, so it names what was renamed or removed; generated stubs are not ours
SKIP = ("CHANGELOG.md", "specdec_rpc/pb/")


def repo_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the file list comes from git", allow_module_level=True)
    files = []
    for name in out:
        p = ROOT / name
        if name and p.is_file() and not name.startswith(SKIP) and "__pycache__" not in name:
            files.append(p)
    return files


FILES = repo_files()
TOP = {p.relative_to(ROOT).parts[0] for p in FILES if len(p.relative_to(ROOT).parts) > 1}


def rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


# ---------------------------------------------------------------- what each kind of file says in prose

def python_prose(path: Path) -> str:
    """A Python file's comments, docstrings and string literals that cite the docs, one paragraph each."""
    src = path.read_text()
    parts = []
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return ""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                parts.append(doc)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "docs/" in node.value \
                and "\\" not in node.value:  # a help text that cites the docs (not a pattern that matches them)
            parts.append(node.value)
    block: list[str] = []
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            block.append(tok.string.lstrip("#").strip())
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT) and block:
            parts.append(" ".join(block))
            block = []
        elif tok.type == tokenize.NEWLINE and block and not tok.line.lstrip().startswith("#"):
            parts.append(" ".join(block))
            block = []
    if block:
        parts.append(" ".join(block))
    return "\n\n".join(parts)


def prose(path: Path) -> str:
    if path.suffix == ".py":
        return python_prose(path)
    return path.read_text(errors="replace")


def scanned() -> list[Path]:
    """Docs, code, protos, manifests, the Makefile and the Dockerfile."""
    out = []
    for p in FILES:
        r = rel(p)
        if p.suffix in (".md", ".py", ".proto") or r in ("Makefile",) or p.name.startswith("Dockerfile") or (
                r.startswith("deploy/") and p.suffix in (".yaml", ".yml", ".json", ".env", ".py")):
            out.append(p)
    return out


# ---------------------------------------------------------------- paths

TOKEN = re.compile(r"[A-Za-z0-9_.\-/*{},<>$]+")
LINK = re.compile(r"\]\(([^)\s]+)\)")
SHA = re.compile(r"`([0-9a-f]{7,40})`")
PLACEHOLDER = re.compile(r"^(?:[A-Z][A-Z0-9_]*|N+|X+)$")


@lru_cache(maxsize=None)
def ignored(first: str) -> bool:
    return subprocess.run(["git", "check-ignore", "-q", first], cwd=ROOT).returncode == 0


@lru_cache(maxsize=None)
def in_commit(sha: str, path: str) -> bool:
    return subprocess.run(["git", "cat-file", "-e", f"{sha}:{path}"], cwd=ROOT, capture_output=True).returncode == 0


def expand(token: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", token)
    if not m:
        return [token]
    return [y for x in m.group(1).split(",") for y in expand(token[:m.start()] + x + token[m.end():])]


def exists(path: str, proto: bool = False) -> bool:
    if "*" in path:
        return any(ROOT.glob(path))
    return (ROOT / path).exists() or (proto and (ROOT / "proto" / path).exists())


def candidate(token: str) -> str | None:
    """The repository path a token names, or None when it names none (a URL, a placeholder, an outside path)."""
    token = token.strip(".,;:'\"`)(").split("::")[0].split("#")[0]
    token = re.sub(r":\d+$", "", token)
    if "/" not in token or token.startswith("/") or "://" in token or "..." in token:
        return None
    segments = [s for s in token.split("/") if s]
    if not segments or segments[0] not in TOP or segments[0].startswith(".cache"):
        return None
    if len(segments) == 2 and segments[0] == "deploy" and segments[1].startswith("specdec-"):
        return None  # a Kubernetes object: kubectl rollout status deploy/specdec-draft
    if any("<" in s or ">" in s or "$" in s or PLACEHOLDER.match(s.split(".")[0]) for s in segments):
        return None
    if ignored(segments[0]):
        return None
    return token.rstrip("/")


def paragraphs(text: str) -> list[str]:
    return re.split(r"\n\s*\n", text)


def missing_paths(path: Path) -> list[str]:
    bad = []
    for para in paragraphs(prose(path)):
        shas = SHA.findall(para)
        names = set()
        for token in TOKEN.findall(para):
            c = candidate(token)
            if c:
                names.add(c)
        if path.suffix == ".md":
            for target in LINK.findall(para):
                target = target.split("#")[0]
                if not target or "://" in target or target.startswith("mailto:"):
                    continue
                resolved = (path.parent / target).resolve()
                try:
                    names.add(resolved.relative_to(ROOT).as_posix())
                except ValueError:
                    bad.append(f"{target} (outside the repository)")
        for name in sorted(names):
            for one in expand(name):
                if not exists(one, path.suffix == ".proto") and not any(in_commit(s, one) for s in shas):
                    bad.append(one)
    return bad


@pytest.mark.parametrize("path", scanned(), ids=rel)
def test_named_paths_exist(path):
    bad = missing_paths(path)
    assert not bad, f"{rel(path)} names paths that are not in the repository: {bad}"


# ---------------------------------------------------------------- cited sections

def plain(heading: str) -> str:
    return re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading).strip()


def slug(heading: str) -> str:
    s = plain(heading).lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


@lru_cache(maxsize=None)
def headings(md: str) -> tuple[list[str], set[str]]:
    text = (ROOT / md).read_text()
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    heads = [h.strip() for h in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, flags=re.M)]
    slugs, seen = set(), {}
    for h in heads:
        s = slug(h)
        n = seen.get(s, 0)
        slugs.add(s if n == 0 else f"{s}-{n}")
        seen[s] = n + 1
    return [plain(h).lower() for h in heads], slugs


CITE = re.compile(r"((?:docs/[\w./-]+|README)\.md),?\s+[\"“']([^\"”'\n]{2,80}?)[\"”']")
ANCHOR = re.compile(r"((?:docs/[\w./-]+|README)\.md)#([\w\-]+)")


def bad_citations(path: Path) -> list[str]:
    text = re.sub(r"\s+", " ", prose(path))
    bad = []
    cites = [(m.group(1), m.group(2)) for m in CITE.finditer(text)]
    anchors = [(m.group(1), m.group(2)) for m in ANCHOR.finditer(text)]
    if path.suffix == ".md":
        for target in LINK.findall(prose(path)):
            if "#" in target and "://" not in target:
                file, anchor = target.split("#", 1)
                file = rel(path) if not file else (path.parent / file).resolve().relative_to(ROOT).as_posix()
                if file.endswith(".md"):
                    anchors.append((file, anchor))
    cites = [(md, section) for md, section in cites if md == "README.md" or candidate(md)]
    anchors = [(md, anchor) for md, anchor in anchors if md == "README.md" or candidate(md)]
    for md, section in cites:
        if not (ROOT / md).is_file():
            bad.append(f"{md} (no such file)")
            continue
        want = re.sub(r"\s+", " ", plain(section)).lower()
        if not any(h.startswith(want) for h in headings(md)[0]):
            bad.append(f'{md}, "{section}"')
    for md, anchor in anchors:
        if not (ROOT / md).is_file():
            bad.append(f"{md} (no such file)")
        elif anchor.lower() not in headings(md)[1]:
            bad.append(f"{md}#{anchor}")
    return bad


@pytest.mark.parametrize("path", scanned(), ids=rel)
def test_cited_sections_exist(path):
    bad = bad_citations(path)
    assert not bad, f"{rel(path)} cites sections that are not headings: {bad}"


# ---------------------------------------------------------------- no development history

def history_scope() -> list[Path]:
    out = []
    for p in FILES:
        r = rel(p)
        if p.suffix in TEXT_SUFFIXES and (r == "README.md" or r.startswith("docs/")
                                          or r.split("/")[0] in PACKAGES):
            out.append(p)
    return out


def test_docs_and_packages_state_facts_not_history():
    hits = []
    for p in history_scope():
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
            if HISTORY.search(line):
                hits.append(f"{rel(p)}:{n}: {line.strip()[:100]}")
    assert not hits, "development history (say what is, not when it changed):\n" + "\n".join(hits)


# ---------------------------------------------------------------- the benchmark page

def test_make_bench_fills_the_generated_section_and_keeps_the_page(tmp_path):
    from specdec_bench.report import BEGIN, END, write_markdown

    page = (ROOT / "docs" / "benchmarks.md").read_text()
    assert page.count(BEGIN) == 1 and page.count(END) == 1 and page.index(BEGIN) < page.index(END)
    make = (ROOT / "Makefile").read_text()
    assert re.search(r"^bench:.*\n(\t.*\n)*\t.*--markdown docs/benchmarks\.md", make, flags=re.M)

    doc = tmp_path / "b.md"
    doc.write_text(page)
    write_markdown(doc, "### greedy\n\n| a |\n")
    new = doc.read_text()
    assert new[:new.index(BEGIN)] == page[:page.index(BEGIN)]
    assert new[new.index(END):] == page[page.index(END):]
    assert "### greedy" in new[new.index(BEGIN):new.index(END)]
    fresh = tmp_path / "fresh.md"
    write_markdown(fresh, "### greedy")
    assert fresh.read_text() == "### greedy\n"
