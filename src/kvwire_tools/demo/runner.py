"""``kvwire demo``: P, D, the router and a colocated reference engine on localhost, as separate processes.

Each prompt goes to the router (disaggregated: P prefills, the KV moves over NIXL, D decodes) and to the
colocated engine (the reference); the two token streams must be identical. Then the table, the JSON and
the plot, and every process is stopped whatever happened.
"""

from __future__ import annotations

import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvwire.errors import KvwireError
from kvwire.testing.procs import Server, ServerGroup, free_port, server_env
from kvwire_tools.demo import report
from kvwire_tools.demo.config import DemoConfig
from kvwire_tools.demo.workload import Result, make_prompts, stream_completion

_MAX_SHOWN_ERRORS = 5


class Cluster:
    """The demo's servers, by role."""

    def __init__(self) -> None:
        self.prefill: list[Server] = []
        self.decode: list[Server] = []
        self.colocated: Server | None = None
        self.router: Server | None = None

    def engines(self) -> list[tuple[str, str]]:
        return [(s.name, s.url) for s in (*self.prefill, *self.decode)]


def _engine_args(cfg: DemoConfig, role: str, port: int, tp: int) -> list[str]:
    args = [
        "serve", role, "--host", "127.0.0.1", "--port", str(port), "--preset", cfg.preset,
        "--seed", str(cfg.seed), "--tp", str(tp),
    ]  # fmt: skip
    if role != "colocated":  # the colocated engine has no connector: no backend, side channel or mode
        args += [
            "--backend",
            cfg.backend,
            "--side-channel-port",
            str(free_port()),
            "--mode",
            cfg.mode.value,
        ]
    if role == "prefill":
        args += ["--pp", str(cfg.p_pp)]
    return args


def start_cluster(cfg: DemoConfig, group: ServerGroup) -> Cluster:
    cluster = Cluster()
    for i in range(cfg.prefill):
        port = free_port()
        cluster.prefill.append(group.start(f"prefill{i}", _engine_args(cfg, "prefill", port, cfg.p_tp), port))
    for i in range(cfg.decode):
        port = free_port()
        cluster.decode.append(group.start(f"decode{i}", _engine_args(cfg, "decode", port, cfg.d_tp), port))
    port = free_port()
    cluster.colocated = group.start("colocated", _engine_args(cfg, "colocated", port, 1), port)
    group.wait_healthy([*cluster.prefill, *cluster.decode, cluster.colocated], cfg.startup_timeout_s)
    port = free_port()
    router_args = ["serve", "router", "--port", str(port), "--request-timeout", str(cfg.request_timeout_s)]
    router_args += ["--mode", cfg.mode.value]
    for s in cluster.prefill:
        router_args += ["--prefill", s.url]
    for s in cluster.decode:
        router_args += ["--decode", s.url]
    cluster.router = group.start("router", router_args, port)
    group.wait_healthy([cluster.router], cfg.startup_timeout_s)
    return cluster


@contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM behaves like Ctrl-C, so the ``finally`` that stops the servers always runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _same(a: Result, b: Result) -> bool:
    if a.token_ids or b.token_ids:
        return a.token_ids == b.token_ids
    return a.text == b.text


def _first_difference(a: Result, b: Result) -> str:
    for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)):
        if x != y:
            return f"token {i}: {x} (disaggregated) != {y} (colocated)"
    return f"lengths {len(a.token_ids)} != {len(b.token_ids)}"


def run_demo(cfg: DemoConfig, console: Console) -> int:
    log_dir = cfg.log_dir or Path(tempfile.mkdtemp(prefix="kvwire-demo-"))
    env = server_env()
    status = 1
    with _terminate_as_interrupt(), ServerGroup(log_dir, env) as group:
        try:
            status = _run(cfg, console, group, log_dir)
        except KvwireError as exc:
            console.print(f"[red]demo failed:[/red] {exc}")
        finally:
            killed = group.stop_all()
            if killed:
                console.print(f"[yellow]killed after the SIGTERM timeout:[/yellow] {', '.join(killed)}")
    if status != 0:
        console.print(f"server logs: {log_dir}")
    elif cfg.log_dir is None:
        shutil.rmtree(log_dir, ignore_errors=True)  # a temporary directory, kept only after a failure
    return status


def _run(cfg: DemoConfig, console: Console, group: ServerGroup, log_dir: Path) -> int:
    console.print(
        f"starting {cfg.prefill} prefill (tp={cfg.p_tp}, pp={cfg.p_pp}), "
        f"{cfg.decode} decode (tp={cfg.d_tp}), "
        f"a colocated reference and the router; {cfg.mode.value} mode, {cfg.backend} backend; "
        f"logs in {log_dir}" + ("" if cfg.log_dir else " (kept if the demo fails)")
    )
    cluster = start_cluster(cfg, group)
    assert cluster.router is not None and cluster.colocated is not None
    prompts = make_prompts(cfg.requests, cfg.min_prompt_tokens, cfg.max_prompt_tokens, cfg.seed)
    disagg: list[Result | None] = [None] * len(prompts)
    coloc: list[Result | None] = [None] * len(prompts)
    errors: list[str] = []
    limits = httpx.Limits(max_connections=2 * cfg.concurrency + 4)
    with httpx.Client(limits=limits, timeout=cfg.request_timeout_s) as client:
        model = str(client.get(cluster.colocated.url + "/health").json().get("model") or "kvwire")
        # One short request down each path first, not counted: the first request of a process pays for
        # lazy imports and allocations that say nothing about the steady state.
        for url in (cluster.router.url, cluster.colocated.url):
            stream_completion(client, url, model, "warm up", 2, cfg.request_timeout_s)

        def one(i: int) -> None:
            assert cluster.router is not None and cluster.colocated is not None
            args = (model, prompts[i], cfg.max_tokens, cfg.request_timeout_s)
            disagg[i] = stream_completion(client, cluster.router.url, *args)
            coloc[i] = stream_completion(client, cluster.colocated.url, *args)

        _drive(cfg, console, group, one, len(prompts), errors)
        stats = report.collect_engine_stats(client, cluster.engines())
    matched = 0
    for i, (d, c) in enumerate(zip(disagg, coloc, strict=True)):
        if d is not None and c is not None:
            if _same(d, c):
                matched += 1
            else:
                errors.append(f"request {i} ({d.prompt_tokens} prompt tokens): {_first_difference(d, c)}")
    data = report.summary(cfg.mode.value, disagg, coloc, matched, stats)
    report.print_table(console, data, disagg, coloc, stats)
    if cfg.json_path is not None:
        report.write_json(cfg.json_path, data)
        console.print(f"wrote {cfg.json_path}")
    if cfg.plot_path is not None:
        report.write_plot(cfg.plot_path, disagg, coloc, data)
        console.print(f"wrote {cfg.plot_path}")
    for line in errors[:_MAX_SHOWN_ERRORS]:
        console.print(f"[red]error:[/red] {line}")
    if len(errors) > _MAX_SHOWN_ERRORS:
        console.print(f"[red]... and {len(errors) - _MAX_SHOWN_ERRORS} more errors[/red]")
    ok = matched == len(prompts) and not errors
    style = "green" if ok else "red"
    console.print(f"[{style}]{matched}/{len(prompts)} matched[/{style}]")
    return 0 if ok else 1


def _drive(
    cfg: DemoConfig,
    console: Console,
    group: ServerGroup,
    one: Callable[[int], None],
    n: int,
    errors: list[str],
) -> None:
    """Run ``one(i)`` for every request with a progress bar; a dead server stops the run."""
    columns = (TextColumn("requests"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    pool = ThreadPoolExecutor(cfg.concurrency, thread_name_prefix="kvwire-demo")
    try:
        with Progress(*columns, console=console) as progress:
            task = progress.add_task("requests", total=n)
            futures: dict[Future[None], int] = {pool.submit(one, i): i for i in range(n)}
            pending = set(futures)
            while pending:
                done, pending = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
                for fut in done:
                    progress.advance(task)
                    exc = fut.exception()
                    if exc is not None:
                        errors.append(f"request {futures[fut]}: {type(exc).__name__}: {exc}")
                group.check_all_alive()
    finally:
        # On a failure, requests still queued are dropped; those running end with the servers.
        pool.shutdown(wait=False, cancel_futures=True)
