"""README.md's layout tree lists exactly the modules and packages of jsteer/."""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def readme_tree() -> set[str]:
    """Paths under jsteer/ named by the README's layout tree ("jsteer/kala/variants/" for a package)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text[text.index("## Layout") :].split("```")[1]
    paths, stack = set(), []
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        name = line.split()[0]
        if indent == 0:
            stack = [name] if name == "jsteer/" else []
            continue
        if not stack:
            continue
        depth = indent // 2
        assert indent % 2 == 0 and 1 <= depth <= len(stack), f"bad indentation: {line!r}"
        stack = stack[:depth] + [name]
        paths.add("".join(stack))
    return paths


def package_tree() -> set[str]:
    """Every module (but __init__.py) and package (folder with __init__.py) below jsteer/."""
    out = set()
    for p in (ROOT / "jsteer").rglob("*.py"):
        rel = p.relative_to(ROOT).as_posix()
        if p.name == "__init__.py":
            if p.parent != ROOT / "jsteer":
                out.add(p.parent.relative_to(ROOT).as_posix() + "/")
        else:
            out.add(rel)
    return out


def test_readme_layout_matches_the_package():
    listed = readme_tree() - {"jsteer/__init__.py"}
    assert "jsteer/__init__.py" in readme_tree()
    have = package_tree()
    assert sorted(listed - have) == [], "listed in README.md's layout but missing from jsteer/"
    assert sorted(have - listed) == [], "in jsteer/ but missing from README.md's layout"
