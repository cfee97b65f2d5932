"""The package's import graph: no circles, and the kernels never import the model.

Reads every module of dsv4_jax, pallas_kernels and checkpoints with `ast` (nothing is
imported), takes every import statement, top-level or inside a function, and looks for a
cycle among the modules."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("dsv4_jax", "pallas_kernels", "checkpoints")


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            parts = f.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = f
    return out


def _resolve(name: str, mods) -> str | None:
    """The longest known module name that `name` is or lies under."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (`import pkg` / `from pkg import name`: the
    package's __init__; `from pkg import mod`: the submodule). A module's own parent
    packages are left out: they are imported before it in any case."""
    mods = _modules()
    graph = {m: set() for m in mods}
    for m, f in mods.items():
        is_pkg = f.name == "__init__.py"
        base = m if is_pkg else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    up = base.split(".")[:len(base.split(".")) - (node.level - 1)]
                    src = ".".join(up + ([node.module] if node.module else []))
                else:
                    src = node.module
                subs = [f"{src}.{a.name}" for a in node.names]
                # `from pkg import mod` imports the module; `from mod import name` the module
                names = [n for n in subs if n in mods] or [src]
            for n in names:
                r = _resolve(n, mods)
                if r and r != m and not m.startswith(r + "."):   # (a parent package runs
                    graph[m].add(r)                               # before its modules)
    return graph


def find_cycle(graph) -> list[str] | None:
    state, stack = {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                c = visit(n)
                if c:
                    return c
        state[m] = 2
        stack.pop()
        return None

    for m in sorted(graph):
        if m not in state:
            c = visit(m)
            if c:
                return c
    return None


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert "dsv4_jax.decode" in graph["dsv4_jax.nnx_model"]   # the graph is not empty
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_kernels_import_neither_the_model_nor_the_checkpoints():
    graph = import_graph()
    bad = {m: sorted(n for n in deps if n.startswith(("dsv4_jax", "checkpoints")))
           for m, deps in graph.items() if m.startswith("pallas_kernels")}
    assert not {m: d for m, d in bad.items() if d}


# The only jits outside programs.py: small programs that are not the model's step (kernel
# wrappers, decode-state and prefix-cache updates, token read-back, samplers, initialisers,
# loaders).
OTHER_JITS = {"dsv4_jax.decode": 3, "dsv4_jax.layers.experts": 1, "dsv4_jax.loading": 1,
              "dsv4_jax.params": 2, "dsv4_jax.pipeline": 1, "dsv4_jax.quant": 1,
              "dsv4_jax.runner": 3, "dsv4_jax.serve.prefix": 2, "dsv4_jax.serve.sampling": 1}


def _jax_jits(f: pathlib.Path) -> int:
    """How many times the module's code names jax.jit / nnx.jit (calls and decorators)."""
    return sum(isinstance(n, ast.Attribute) and n.attr == "jit" and isinstance(n.value, ast.Name)
               and n.value.id in ("jax", "nnx")
               for n in ast.walk(ast.parse(f.read_text(), str(f))))


def test_the_model_is_jitted_in_programs_only():
    """Every compiled program of the model comes from programs.py (one builder per kind:
    step_program, decode_program, verify_programs, generate_loop, each for every layout);
    a new jax.jit elsewhere must be one of the small non-model programs listed above."""
    mods = _modules()
    got = {m: n for m, f in mods.items() if m.startswith("dsv4_jax") and m != "dsv4_jax.programs"
           and (n := _jax_jits(f))}
    assert got == OTHER_JITS
    src = (ROOT / "dsv4_jax" / "programs.py").read_text()
    builders = [n.name for n in ast.parse(src).body
                if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")
                and "jax.jit" in ast.get_source_segment(src, n)]
    assert builders == ["step_program", "decode_program", "verify_programs", "generate_loop"]
