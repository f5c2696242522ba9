"""The docs hold together: every relative link and #anchor in README.md and docs/ resolves, the
README stays a short entry page, and the generated references match their generators."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def anchors(path):
    """GitHub-style heading slugs of a Markdown file (headings inside code fences ignored)."""
    out, fence = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        if fence or not line.startswith("#"):
            continue
        title = line.lstrip("#").strip().lower()
        out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_every_relative_link_and_anchor_resolves():
    bad = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for link in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", link):
                continue  # http(s), mailto: not checked offline
            target, _, anchor = link.partition("#")
            path = (page.parent / target).resolve() if target else page
            if not path.exists():
                bad.append(f"{page.relative_to(ROOT)}: {link} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                bad.append(f"{page.relative_to(ROOT)}: {link} (no such heading)")
    assert not bad, "\n".join(bad)


def test_readme_is_an_entry_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 220
    for guide in (
        "porting-a-loop",
        "o2-and-fp8",
        "when-training-goes-wrong",
        "will-it-fit",
        "choose-by-measurement",
        "trainer-and-checkpoints",
        "distributed",
        "service",
    ):
        assert (
            f"docs/guides/{guide}.md" in readme
            and (ROOT / "docs" / "guides" / f"{guide}.md").exists()
        )
    for ref in ("cli", "config", "jsonl-schema", "rest-api"):
        assert f"docs/reference/{ref}.md" in readme


def test_every_ampkit_command_in_a_code_block_parses():
    """Each ``ampkit ...`` line in the README's and the guides' code blocks is one a shell passes
    to the CLI as written (backslash continuations joined as a shell joins them; ``...`` stands for
    more flags): the guide's 8B plan broke ``--model_config`` across lines, so its second half
    reached ``plan`` as an unexpected argument. Parsed only, nothing runs."""
    import contextlib
    import io
    import shlex

    from ampkit.cli import build_parser

    bad = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs" / "guides").glob("*.md"))]:
        blocks = re.findall(r"^```[a-z]*\n(.*?)^```", page.read_text(), flags=re.S | re.M)
        for block in blocks:
            for line in block.replace("\\\n", "").splitlines():
                line = line.strip().removeprefix("$ ")
                words = shlex.split(line, comments=True) if line.startswith("ampkit ") else []
                if len(words) < 2 or words[1].endswith(":") or not words[1][0].isalpha():
                    continue  # an output line ("ampkit train: error ...", "ampkit 0.1.0 · ...")
                ends = [i for i, w in enumerate(words) if w in ("&&", "&", "|", ">", ";")]
                words = [w for w in words[: min(ends, default=len(words))] if w != "..."]
                err = io.StringIO()
                try:
                    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                        build_parser().parse_args(words[1:])
                except SystemExit as e:
                    if e.code:
                        bad.append(f"{page.relative_to(ROOT)}: {line}\n  {err.getvalue().strip()}")
    assert not bad, "\n".join(bad)
