"""No module of `src` imports itself back, through any chain (TYPE_CHECKING imports count).

import-linter's layers keep packages in order; this keeps the modules inside each package in
order too, so that each can be read, tested and changed from the bottom up.
"""

from __future__ import annotations

import grimp


def strongly_connected(graph: grimp.ImportGraph) -> list[list[str]]:
    """Tarjan's components of more than one module: each is a set of modules in a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in graph.find_modules_directly_imported_by(module):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def test_no_module_inside_src_imports_itself_back() -> None:
    graph = grimp.build_graph("vkubelet", include_external_packages=False)
    cycles = strongly_connected(graph)
    chains = [
        " -> ".join(graph.find_shortest_chain(importer=c[0], imported=c[1]) or c) for c in cycles
    ]
    assert not cycles, "modules in an import cycle:\n" + "\n".join(
        f"{', '.join(c)}\n  e.g. {chain}" for c, chain in zip(cycles, chains, strict=True)
    )
