#!/usr/bin/env python3
"""The daemon's shape (issue: rebuild the core around its operations), held by a test:
- no daemon source file above 900 lines;
- no struct above 40 members (a declaration "int a, b;" counts two);
- no daemon header that more than a third of the daemon's .c files include;
- only transport/ calls libfabric, only coll/tag.h packs a tag, and coll/, transport/ and
  cluster/ include only their own headers, the lower libraries' (sd/) and the few named below;
- no function nested deeper than MAX_DEPTH braces;
- the modules' states listed in OPAQUE are defined only in their own .c (or the private header
  of a module of several files, which only the files listed in PRIVATE include);
- no function declared or defined with more than 8 positional parameters (a parameter struct
  instead: sd_job_net_allreduce had 13);
- no include cycle among the daemon's headers, and none among its modules (a module: a .c with
  its .h, and the parts PART_OF names), neither as the #include lines say nor, given the build's
  object directory, as the compiler resolved them (its dependency files, every header a source
  reaches): the layers are the lower floors, the job's core (job.c, registry.c, session.c,
  job_net.c, ...), the operations (quant < push, fetch, weights < step < loading < resume <
  checkpoint), and above them the job's life, the jobs as a whole, registration, dispatch and the
  server. A lower one tells a higher one through the job's events and the module interface
  (job_module.h), or a callback the higher one handed it (the network service's serve, the
  schedule's driver, a session's link). It was one cycle of 19 modules around job.c.
Usage: test_shape.py DAEMON_DIR [OBJECT_DIR]"""
import os
import re
import sys

from checks import check, finish

MAX_LINES = 900
MAX_MEMBERS = 40
MAX_PARAMS = 8
MAX_DEPTH = 5  # braces deep inside a function, its body counting 1 (save_plan was 9)
MAX_MODULE_CYCLE = 0  # none (19 when it was first measured)
# the operations, each owning its state behind the module interface: no cycle among them (the
# order they are layered in: quant < push, fetch, weights < step < loading < resume < checkpoint)
OPERATIONS = ("push", "fetch", "unit_cache", "slot_pool", "step", "optimizer", "weights",
              "secondary", "quant", "checkpoint", "resume", "loading", "schedule")
# the middle's folders (daemon/CMakeLists.txt puts each on the include path)
MIDDLE = ("server", "jobs", "ops", "persist", "net")
# files that are parts of another module (the rest: a module each, its .c with its .h)
PART_OF = {"ckpt_commit": "checkpoint", "fetch_serve": "fetch", "job_mem": "job_life", "ckpt_load": "checkpoint", "step_state": "step", "hop": "step", "push_net": "push",
           "push_round": "push", "net": "job_net", "attach": "server", "registry": "job",
           "recover": "checkpoint", "job_trace": "job"}
# a module's state defined only in its own .c (opaque elsewhere): the ones that are so far
OPAQUE = {
    "sd_net": "net/net_service.c",
    "sd_job_sched": "ops/schedule.c",
    "sd_sec_state": "ops/secondary.c",
    "sd_push_state": "ops/push_int.h",
    "sd_quant_state": "ops/quant.c",
    "sd_step_state": "ops/step_int.h",
    "sd_optim_state": "ops/optimizer.c",
    "sd_loading_state": "ops/loading.c",
    "sd_ckpt_job": "persist/checkpoint_int.h",
    "sd_resume_state": "persist/resume.c",
}
# a module of several files: its private header, and the files that may include it
PRIVATE = {
    "ops/step_int.h": ("ops/step.c", "ops/step_state.c", "ops/hop.c"),
    "ops/push_int.h": ("ops/push.c", "ops/push_net.c"),
    "persist/checkpoint_int.h": ("persist/checkpoint.c", "persist/ckpt_commit.c",
                                 "persist/ckpt_load.c"),
    "cluster/cluster_int.h": ("cluster/links.c", "cluster/handshake.c",
                              "cluster/coordinator.c", "cluster/probe.c", "cluster/state.c",
                              "cluster/peers.c", "cluster/send.c", "cluster/meet.c",
                              "cluster/meet_wire.c"),
}
# what each lower floor may include besides its own headers and sd/ (the build links each floor
# alone as well: daemon/CMakeLists.txt, layer_check)
FLOOR_INCLUDES = {
    "transport": ("coll/tag.h",),
    "coll": ("transport/transport.h",),
    "cluster": ("transport/transport.h", "shard.pb-c.h"),
}



def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def struct_members(text):
    """(name, members) of every struct body in text, nested ones separately."""
    out = []
    for m in re.finditer(r"\bstruct\s+(\w+)\s*\{", text):
        depth, i, start = 1, m.end(), m.end()
        while depth and i < len(text):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        body = text[start:i - 1]
        # the struct's own declarations: drop nested bodies, then count declarators
        flat, depth = [], 0
        for ch in body:
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            elif depth == 0:
                flat.append(ch)
        n = 0
        for decl in "".join(flat).split(";"):
            decl = re.sub(r"\([^()]*\)", "()", decl.strip())  # function pointer arguments
            if decl:
                n += decl.count(",") + 1
        out.append((m.group(1), n))
    return out


def function_params(text):
    """(name, parameters) of every function declared or defined in text (comments stripped)"""
    out = []
    for m in re.finditer(r"^[A-Za-z_][\w \t\*]*?\b(\w+)\s*\(([^;{}()]*(?:\([^()]*\)[^;{}()]*)*)\)"
                         r"\s*[{;]", text, re.M):
        name, args = m.group(1), m.group(2).strip()
        if name in ("if", "while", "for", "switch", "return", "sizeof") or args in ("", "void"):
            continue
        depth, n = 0, 1
        for ch in args:
            depth += {"(": 1, ")": -1}.get(ch, 0)
            n += ch == "," and depth == 0
        out.append((name, n))
    return out


def brace_depths(text):
    """(function, deepest brace level) of every function in text (comments stripped)"""
    text = re.sub(r'"(\\.|[^"\\])*"', '""', text)
    text = re.sub(r"'(\\.|[^'\\])'", "''", text)
    depth, fn, best = 0, None, {}
    for line in text.split("\n"):
        m = re.match(r"^[A-Za-z].*?(\w+)\(", line)
        if depth == 0 and m:
            fn = m.group(1)
        for ch in line:
            if ch == "{":
                depth += 1
                best[fn] = max(best.get(fn, 0), depth)
            elif ch == "}":
                depth -= 1
    return best


def include_graph(files, text, root):
    """{file: [files it includes]} over the daemon's own files (quoted includes, as the
    compiler resolves them: beside the includer, then from the daemon's root)"""
    rel = {os.path.relpath(f, root): f for f in files}
    # the middle's folders are on the include path: a header there is included by its name
    by_name = {os.path.basename(r): r for r in rel if r.split("/")[0] in MIDDLE}
    graph = {}
    for r, f in rel.items():
        out = []
        for inc in re.findall(r'#include\s+"([^"]+)"', strip_comments(text[f])):
            near = os.path.normpath(os.path.join(os.path.dirname(r), inc))
            hit = near if near in rel else inc if inc in rel else by_name.get(inc)
            if hit is not None:
                out.append(hit)
        graph[r] = out
    return graph


def cycles(graph):
    """the strongly connected components of graph with more than one node, or with a loop"""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def compiler_deps(obj_dir, root):
    """{source: [daemon headers it reaches]} from the compiler's dependency files (X.c.o.d) under
    obj_dir, paths relative to root"""
    root = os.path.realpath(root)
    deps = {}
    for d, _, names in os.walk(obj_dir):
        for n in names:
            if not n.endswith(".c.o.d"):
                continue
            text = open(os.path.join(d, n)).read().replace("\\\n", " ")
            paths = [os.path.realpath(x) for x in text.split(":", 1)[1].split()]
            ours = [os.path.relpath(x, root) for x in paths if x.startswith(root + os.sep)]
            if ours and ours[0].endswith(".c"):
                deps[ours[0]] = [x for x in ours[1:] if x.endswith(".h")]
    return deps


def module_of(rel):
    base = re.sub(r"_int$", "", os.path.splitext(os.path.basename(rel))[0])
    return PART_OF.get(base, base)


def main():
    root = sys.argv[1]
    files = []
    for d, _, names in os.walk(root):
        files += [os.path.join(d, n) for n in names if n.endswith((".c", ".h"))]
    sources = [f for f in files if f.endswith(".c")]
    check(len(sources) >= 20, "found %d daemon sources under %s" % (len(sources), root))
    text = {f: open(f).read() for f in files}
    for f in files:
        rel = os.path.relpath(f, root)
        lines = text[f].count("\n")
        check(lines <= MAX_LINES, "%s has %d lines (at most %d)" % (rel, lines, MAX_LINES))
        for name, n in struct_members(strip_comments(text[f])):
            check(n <= MAX_MEMBERS, "%s: struct %s has %d members (at most %d)" %
                  (rel, name, n, MAX_MEMBERS))
        funcs = function_params(strip_comments(text[f]))
        check(not [x for x in funcs if x[1] > MAX_PARAMS], "%s: functions with more than %d "
              "positional parameters: %s" % (rel, MAX_PARAMS,
                                             [x for x in funcs if x[1] > MAX_PARAMS]))
        if f.endswith(".c"):
            deep = [(fn, d) for fn, d in brace_depths(strip_comments(text[f])).items()
                    if d > MAX_DEPTH]
            check(not deep, "%s: functions nested deeper than %d braces: %s" %
                  (rel, MAX_DEPTH, deep))
    n_funcs = sum(len(function_params(strip_comments(t))) for t in text.values())
    check(n_funcs > 300, "the parameter count sees the daemon's functions: %d" % n_funcs)

    # no header that more than a third of the daemon includes (daemon.h was included by 12 of
    # 14 files; ops.h, every operation's interface in one, by 17 of 38 before it was split)
    graph = include_graph(files, text, root)
    by_name = {os.path.relpath(f, root): f for f in files if f.endswith(".h")}
    reach = {h: 0 for h in by_name}
    for f in sources:
        for inc in set(graph[os.path.relpath(f, root)]):
            if inc in reach:
                reach[inc] += 1
    check(max(reach.values()) > 5, "the reach count sees the includes: %d at most" %
          max(reach.values()))
    for h, n in reach.items():
        check(3 * n <= len(sources), "%s is included by %d of %d daemon sources" %
              (h, n, len(sources)))

    for f in files:
        rel = os.path.relpath(f, root)
        code = strip_comments(text[f])
        if not rel.startswith("transport/"):
            check(not re.search(r"\bfi_\w+\s*\(", code), "%s calls libfabric" % rel)
        if rel != "coll/tag.h":
            check(not re.search(r"<<\s*(60|48|34|18)\b", code), "%s packs a tag by hand" % rel)
        floor = rel.split("/")[0]
        if floor in FLOOR_INCLUDES:
            for inc in re.findall(r'#include\s+"([^"]+)"', code):
                check(inc.startswith(("sd/", floor + "/")) or inc in FLOOR_INCLUDES[floor],
                      "%s includes %s: the %s floor may include its own headers, common's and "
                      "gpu's (sd/), and %s" % (rel, inc, floor, FLOOR_INCLUDES[floor]))
    for name, owner in OPAQUE.items():
        where = [os.path.relpath(f, root) for f in files
                 if re.search(r"\bstruct\s+%s\s*\{" % name, strip_comments(text[f]))]
        check(where == [owner], "struct %s is defined in %s, only %s may (the module's own "
              "state)" % (name, where, owner))
    headers = {h: [x for x in inc if x.endswith(".h")] for h, inc in graph.items()
               if h.endswith(".h")}
    check(len(headers) > 20 and sum(map(len, headers.values())) > 20,
          "the include graph sees the headers: %d, %d includes" %
          (len(headers), sum(map(len, headers.values()))))
    check(not cycles(headers), "headers that include each other: %s" % cycles(headers))
    modules = {}
    for f, inc in graph.items():
        modules.setdefault(module_of(f), set()).update(module_of(x) for x in inc
                                                       if module_of(x) != module_of(f))
    ops = {m: {x for x in inc if x in OPERATIONS} for m, inc in modules.items() if m in OPERATIONS}
    check(len(ops) == len(OPERATIONS) and sum(map(len, ops.values())) >= 10,
          "the operations' graph sees them and their includes: %s" % sorted(ops))
    check(not cycles(ops), "operation modules that include each other's headers: %s" % cycles(ops))
    worst = max((len(c) for c in cycles(modules)), default=0)
    print("the largest cycle of modules: %d modules" % worst)
    check(worst <= MAX_MODULE_CYCLE, "modules that include each other's headers: a cycle of %d "
          "(at most %d): %s" % (worst, MAX_MODULE_CYCLE, cycles(modules)))

    if len(sys.argv) > 2:  # as the compiler resolved the includes
        deps = compiler_deps(sys.argv[2], root)
        check(len(deps) >= 20 and sum(map(len, deps.values())) > 100,
              "the compiler's dependency files under %s name the daemon's sources and headers: "
              "%d sources" % (sys.argv[2], len(deps)))
        reached = {}
        for src, hs in deps.items():
            reached.setdefault(module_of(src), set()).update(
                module_of(h) for h in hs if module_of(h) != module_of(src))
        check(not cycles(reached), "modules whose sources reach each other's headers (the "
              "compiler's dependency files): %s" % cycles(reached))

    for header, allowed in PRIVATE.items():
        check(header in by_name, "the private header %s exists" % header)
        base = os.path.basename(header)
        users = sorted(os.path.relpath(f, root) for f in files
                       if f != by_name.get(header) and
                       re.search(r'#include\s+"(%s|%s)"' % (re.escape(header), re.escape(base)),
                                 text[f]))
        check(set(users) <= set(allowed), "%s is included by %s: only %s may (the module's "
              "private header)" % (header, users, list(allowed)))
    return finish("test_shape")


if __name__ == "__main__":
    sys.exit(main())
