#!/usr/bin/env python3
"""The directories' READMEs stay true about what is in them: every source file of common/,
proto/, gpu/, client/, daemon/, tools/ and tests/ is named in its directory's README.md (by its
path below the directory or its file name; a header whose .c of the same name is named counts as
named with it), and every test of tests/ is in tests/README.md's lists. A file added without a
line in its README fails this test; so does a page of docs/ that docs/README.md does not list.
docs/configuration.md's table has a row for each entry
of common/config.c's sd_config_table and no other, each with the table's default (shardd --help
prints the same table). And no script or test stops processes by name (pkill, killall): a
production shardd beside a benchmark or a test run stays up.
Usage: test_docs.py SOURCE_ROOT"""
import os
import re
import sys

from checks import check, finish

DIRS = ("common", "proto", "gpu", "client", "daemon", "tools", "tests")
EXTS = (".c", ".h", ".py", ".sh", ".cu", ".hip", ".cmake", ".proto")
CONFIG_DOC = os.path.join("docs", "configuration.md")  # the table shardd --help prints
SKIP_DIRS = ("__pycache__", "corpus")



def sources(top):
    for d, dirs, names in os.walk(top):
        dirs[:] = [x for x in dirs if x not in SKIP_DIRS and not x.startswith(".")]
        for n in names:
            if n.endswith(EXTS):
                yield os.path.relpath(os.path.join(d, n), top)


def named(readme, rel):
    base = os.path.basename(rel)
    return ("`%s`" % rel) in readme or base in readme


def config_table(root):
    """docs/configuration.md's rows ("| `name` | type | default | ...") against sd_config_table"""
    with open(os.path.join(root, "common", "config.c")) as f:
        entries = re.findall(r'^    \{"([a-z_0-9]+)", SD_CFG_[A-Z]+, "([^"]*)"', f.read(), re.M)
    with open(os.path.join(root, CONFIG_DOC)) as f:
        rows = re.findall(r"^\| `([a-z_0-9]+)` \| [a-z]+ \| ([^|]*) \|", f.read(), re.M)
    check(len(entries) > 40, "the walk saw sd_config_table: %d entries" % len(entries))
    table, readme = dict(entries), dict(rows)
    for name in sorted(set(table) - set(readme)):
        check(False, "config option %s (common/config.c) has no row in %s's table" %
              (name, CONFIG_DOC))
    for name in sorted(set(readme) - set(table)):
        check(False, "%s's table has a row for %s, which common/config.c does not "
              "have" % (CONFIG_DOC, name))
    for name in sorted(set(table) & set(readme)):
        shown = readme[name].strip().strip("`")
        check(shown == table[name] or (table[name] == "" and shown.startswith("(empty")),
              "config option %s: %s's default '%s', common/config.c's '%s'" %
              (name, CONFIG_DOC, shown, table[name]))


def main():
    root = sys.argv[1]
    total = 0
    for d in DIRS:
        top = os.path.join(root, d)
        path = os.path.join(top, "README.md")
        check(os.path.isfile(path), "%s has no README.md" % d)
        if not os.path.isfile(path):
            continue
        readme = open(path).read()
        for rel in sorted(sources(top)):
            total += 1
            if rel.endswith(".h") and named(readme, rel[:-2] + ".c"):
                continue
            check(named(readme, rel), "%s/%s is not named in %s/README.md" % (d, rel, d))
    check(total > 150, "the walk saw the sources: %d files" % total)
    with open(os.path.join(root, "docs", "README.md")) as f:
        index = f.read()
    for page in sorted(os.listdir(os.path.join(root, "docs"))):
        if page.endswith(".md") and page != "README.md":
            check("`%s`" % page in index, "docs/%s is not listed in docs/README.md" % page)
    config_table(root)
    by_name = re.compile(r"\b(pkill|killall)\b")
    me = os.path.abspath(__file__)
    for d in ("tools", "tests"):
        for rel in sources(os.path.join(root, d)):
            path = os.path.join(root, d, rel)
            if os.path.abspath(path) == me:
                continue
            with open(path, errors="replace") as f:
                hits = [i + 1 for i, line in enumerate(f) if by_name.search(line)]
            check(not hits, "%s/%s stops processes by name (pkill/killall) at lines %s: stop "
                  "the pids it started" % (d, rel, hits))
    return finish("test_docs")


if __name__ == "__main__":
    sys.exit(main())
