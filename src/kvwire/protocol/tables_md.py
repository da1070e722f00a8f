"""Render the transition tables as markdown, for ``docs/protocol.md`` (a test keeps the two in sync)."""

from __future__ import annotations

from typing import Any

from kvwire.protocol.states import ALL_TABLES, TransitionTable


def render_table(table: TransitionTable[Any, Any]) -> str:
    lines = [
        f"Role `{table.role}`; starts in `{table.initial.name}`; terminal: "
        + ", ".join(f"`{s.name}`" for s in table.states if s in table.terminal)
        + ".",
        "",
        "| state | event → next state |",
        "|---|---|",
    ]
    for state in table.states:
        edges = [f"`{e.name}` → `{n.name}`" for (s, e), n in table.transitions.items() if s is state]
        if edges or state is table.initial:
            lines.append(f"| `{state.name}` | {'<br>'.join(edges) or '(terminal)'} |")
        elif state in table.terminal:
            lines.append(f"| `{state.name}` | (terminal) |")
    return "\n".join(lines) + "\n"


def render_all() -> str:
    return "\n".join(f"### `{t.role}`\n\n{render_table(t)}" for t in ALL_TABLES)


if __name__ == "__main__":
    print(render_all())
